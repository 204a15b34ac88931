package deploy

import (
	"slices"
	"strings"
	"testing"

	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
)

// hookObjects decodes the helm hooks of a rendered chart.
type hookObjects struct {
	sa      *corev1.ServiceAccount
	role    *rbacv1.Role
	rb      *rbacv1.RoleBinding
	job     *batchv1.Job
	weights map[string]string
}

func decodeHooks(t *testing.T, objs []*unstructured.Unstructured) hookObjects {
	t.Helper()
	h := hookObjects{weights: map[string]string{}}
	for _, o := range objs {
		a := o.GetAnnotations()
		if a["helm.sh/hook"] != "pre-delete" {
			t.Errorf("%s %s: hook %q, want pre-delete only", o.GetKind(), o.GetName(), a["helm.sh/hook"])
		}
		if p := a["helm.sh/hook-delete-policy"]; !strings.Contains(p, "hook-succeeded") || !strings.Contains(p, "before-hook-creation") {
			t.Errorf("%s %s: delete policy %q leaves objects behind", o.GetKind(), o.GetName(), p)
		}
		h.weights[o.GetKind()] = a["helm.sh/hook-weight"]
		var dst any
		switch o.GetKind() {
		case "ServiceAccount":
			h.sa = &corev1.ServiceAccount{}
			dst = h.sa
		case "Role":
			h.role = &rbacv1.Role{}
			dst = h.role
		case "RoleBinding":
			h.rb = &rbacv1.RoleBinding{}
			dst = h.rb
		case "Job":
			h.job = &batchv1.Job{}
			dst = h.job
		default:
			t.Fatalf("unexpected hook %s %s", o.GetKind(), o.GetName())
		}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructuredWithValidation(o.Object, dst, true); err != nil {
			t.Fatalf("%s %s: %v", o.GetKind(), o.GetName(), err)
		}
	}
	if h.sa == nil || h.role == nil || h.rb == nil || h.job == nil {
		t.Fatalf("want a ServiceAccount, Role, RoleBinding and Job hook, got weights %v", h.weights)
	}
	return h
}

// helm uninstall's pre-delete hook: a Job with just the right to delete
// the release's DaemonSet and its signal (the same the agents watch),
// reaching the API server as the agent does, that runs the image's
// uninstall program. Its RBAC is created before it.
func TestUninstallHook(t *testing.T) {
	for name, c := range map[string]struct {
		args                       []string
		ds, command, timeout, host string
	}{
		"defaults":   {nil, "ambient-cni", "/usr/local/bin/ambient-cni-uninstall", "4m", ""},
		"all values": {[]string{"-f", allValues}, "mesh-node", "/custom/bin/mesh-uninstall", "7m30s", "api.mesh.example.com"},
	} {
		o := decode(t, render(t, "rel", "hook-ns", c.args...))
		h := decodeHooks(t, o.hooks)
		if h.weights["Job"] != "0" || h.weights["Role"] != "-10" || h.weights["RoleBinding"] != "-10" || h.weights["ServiceAccount"] != "-10" {
			t.Errorf("%s: weights %v: RBAC must come before the Job", name, h.weights)
		}
		const signal = "ambient-cni-rel-installed"
		want := []rbacv1.PolicyRule{
			{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{c.ds}, Verbs: []string{"get", "delete"}},
			{APIGroups: []string{""}, Resources: []string{"services"}, ResourceNames: []string{signal}, Verbs: []string{"delete"}},
		}
		if !slices.EqualFunc(h.role.Rules, want, func(a, b rbacv1.PolicyRule) bool {
			return slices.Equal(a.Verbs, b.Verbs) && slices.Equal(a.ResourceNames, b.ResourceNames) &&
				slices.Equal(a.Resources, b.Resources) && slices.Equal(a.APIGroups, b.APIGroups)
		}) {
			t.Errorf("%s: hook role rules %+v, want %+v", name, h.role.Rules, want)
		}
		if h.rb.RoleRef.Name != h.role.Name || len(h.rb.Subjects) != 1 || h.rb.Subjects[0].Name != h.sa.Name || h.rb.Subjects[0].Namespace != "hook-ns" {
			t.Errorf("%s: binding %+v does not bind the hook role to the hook account", name, h.rb)
		}
		spec := h.job.Spec.Template.Spec
		if spec.ServiceAccountName != h.sa.Name || spec.RestartPolicy != corev1.RestartPolicyNever || !spec.HostNetwork {
			t.Errorf("%s: job pod account %q restart %q hostNetwork %v", name, spec.ServiceAccountName, spec.RestartPolicy, spec.HostNetwork)
		}
		ctr := spec.Containers[0]
		agent := o.container(t)
		if ctr.Image != agent.Image || ctr.ImagePullPolicy != agent.ImagePullPolicy || !slices.Equal(ctr.Command, []string{c.command}) {
			t.Errorf("%s: job runs %v from %s (%s), want %s from the agent's image %s", name, ctr.Command, ctr.Image, ctr.ImagePullPolicy, c.command, agent.Image)
		}
		env := map[string]string{}
		for _, e := range ctr.Env {
			env[e.Name] = e.Value
		}
		agentEnv := o.env(t)
		if env["AMBIENT_DAEMONSET_NAME"] != c.ds || env["AMBIENT_UNINSTALL_TIMEOUT"] != c.timeout ||
			env["AMBIENT_RELEASE_SIGNAL"] != signal || agentEnv["AMBIENT_RELEASE_SIGNAL"] != signal ||
			env["KUBERNETES_SERVICE_HOST"] != c.host || env["KUBERNETES_SERVICE_HOST"] != agentEnv["KUBERNETES_SERVICE_HOST"] ||
			env["KUBERNETES_SERVICE_PORT"] != agentEnv["KUBERNETES_SERVICE_PORT"] ||
			env["AMBIENT_LOG_FORMAT"] != agentEnv["AMBIENT_LOG_FORMAT"] {
			t.Errorf("%s: job env %v", name, env)
		}
		sc := ctr.SecurityContext
		if sc == nil || sc.RunAsNonRoot == nil || !*sc.RunAsNonRoot || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
			sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) != 0 {
			t.Errorf("%s: job security context %+v: want non-root, no capabilities", name, sc)
		}
	}
}

// The plain manifest is applied with kubectl, which would run a hook at
// once: it holds none.
func TestManifestHasNoHooks(t *testing.T) {
	if o := decode(t, readManifest(t)); len(o.hooks) > 0 {
		t.Errorf("the manifest holds %d helm hooks", len(o.hooks))
	}
}
