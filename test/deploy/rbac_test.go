package deploy

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

func readManifest(t testing.TB) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot(t), manifestPath))
	if err != nil {
		t.Fatalf("%v; run make manifests", err)
	}
	return b
}

// The roles in the manifest are exactly what the agent's end-to-end tests
// run under, and its bindings give them to the DaemonSet's ServiceAccount.
func TestManifestRBACIsShippedRBAC(t *testing.T) {
	manifest := readManifest(t)
	cluster, namespaced, err := kubeenv.RoleRules(manifest)
	if err != nil {
		t.Fatal(err)
	}
	shippedCluster, shippedNamespaced, err := kubeenv.RoleRules(kubeenv.ShippedRBAC(t))
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(cluster, shippedCluster) || !reflect.DeepEqual(namespaced, shippedNamespaced) {
		t.Errorf("manifest rules differ from kubeenv.ShippedRBAC:\nmanifest %+v %+v\nshipped  %+v %+v", cluster, namespaced, shippedCluster, shippedNamespaced)
	}

	o := decode(t, manifest)
	subject := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: o.sa.Name, Namespace: o.sa.Namespace}
	if o.crb.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: o.cr.Name}) ||
		!reflect.DeepEqual(o.crb.Subjects, []rbacv1.Subject{subject}) {
		t.Errorf("ClusterRoleBinding %+v does not bind ClusterRole %s to %+v", o.crb, o.cr.Name, subject)
	}
	if o.rb.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: o.role.Name}) ||
		!reflect.DeepEqual(o.rb.Subjects, []rbacv1.Subject{subject}) || o.rb.Namespace != o.role.Namespace {
		t.Errorf("RoleBinding %+v does not bind Role %s to %+v", o.rb, o.role.Name, subject)
	}
	if o.role.Namespace != o.ds.Namespace {
		t.Errorf("Role in %s, DaemonSet in %s", o.role.Namespace, o.ds.Namespace)
	}
	for _, r := range o.role.Rules {
		if reflect.DeepEqual(r.Resources, []string{"serviceaccounts/token"}) {
			if !reflect.DeepEqual(r.ResourceNames, []string{o.pluginSA.Name}) || !reflect.DeepEqual(r.Verbs, []string{"create"}) {
				t.Errorf("Role rule %+v: want create on the plugin's ServiceAccount %s only", r, o.pluginSA.Name)
			}
			continue
		}
		// DaemonSets in its namespace: get its own by name; list any
		// (the chart's others by label: a rename is no uninstall); watch
		// none. The release's signal: get, list and watch by name, it
		// alone.
		want := rbacv1.PolicyRule{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{o.ds.Name}, Verbs: []string{"get"}}
		switch {
		case reflect.DeepEqual(r.Resources, []string{"services"}):
			want = rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"services"}, ResourceNames: []string{o.signal.Name}, Verbs: []string{"get", "list", "watch"}}
		case r.ResourceNames == nil:
			want = rbacv1.PolicyRule{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, Verbs: []string{"list"}}
		}
		if !reflect.DeepEqual(r, want) {
			t.Errorf("Role rule %+v, want %+v", r, want)
		}
	}

	// A renamed release grants the same, on its own DaemonSet's name.
	// The all-values file names platform openshift, which may also use
	// the privileged SCC, and turns the startup taint on: patch on nodes.
	all := decode(t, render(t, "all", "all-values-ns", "-f", allValues))
	wantCluster := append(slices.Clone(o.cr.Rules), rbacv1.PolicyRule{
		APIGroups: []string{"security.openshift.io"}, Resources: []string{"securitycontextconstraints"},
		ResourceNames: []string{"privileged"}, Verbs: []string{"use"},
	}, rbacv1.PolicyRule{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"patch"}})
	if !reflect.DeepEqual(all.cr.Rules, wantCluster) {
		t.Errorf("all-values ClusterRole rules %+v differ from the manifest's plus the SCC's and the startup taint's %+v", all.cr.Rules, wantCluster)
	}
	want := []rbacv1.PolicyRule{{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{"mesh-node"}, Verbs: []string{"get"}},
		{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, Verbs: []string{"list"}},
		{APIGroups: []string{""}, Resources: []string{"services"}, ResourceNames: []string{"ambient-cni-all-installed"}, Verbs: []string{"get", "list", "watch"}},
		{APIGroups: []string{""}, Resources: []string{"serviceaccounts/token"}, ResourceNames: []string{"mesh-node-plugin"}, Verbs: []string{"create"}}}
	if !reflect.DeepEqual(all.role.Rules, want) {
		t.Errorf("all-values Role rules %+v, want %+v", all.role.Rules, want)
	}
	// The plugin's own roles: get on pods, namespaces and nodes (the node:
	// whether the agent's DaemonSet still runs there), and get on the
	// agent's DaemonSet by name in its namespace; nothing else, bound to
	// its own ServiceAccount only.
	wantPlugin := []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods", "namespaces"}, Verbs: []string{"get"}},
		{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get"}}}
	if !reflect.DeepEqual(o.pluginCR.Rules, wantPlugin) {
		t.Errorf("plugin ClusterRole rules %+v, want %+v", o.pluginCR.Rules, wantPlugin)
	}
	pluginSubject := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: o.pluginSA.Name, Namespace: o.pluginSA.Namespace}
	if o.pluginCRB.RoleRef.Name != o.pluginCR.Name || !reflect.DeepEqual(o.pluginCRB.Subjects, []rbacv1.Subject{pluginSubject}) {
		t.Errorf("plugin ClusterRoleBinding %+v", o.pluginCRB)
	}
	for _, rendered := range []struct {
		o  *objects
		ds string
	}{{o, o.ds.Name}, {all, "mesh-node"}} {
		wantRole := []rbacv1.PolicyRule{{APIGroups: []string{"apps"}, Resources: []string{"daemonsets"}, ResourceNames: []string{rendered.ds}, Verbs: []string{"get"}}}
		r := rendered.o
		if !reflect.DeepEqual(r.pluginRole.Rules, wantRole) || r.pluginRole.Namespace != r.ds.Namespace {
			t.Errorf("plugin Role in %s: rules %+v, want %+v in %s", r.pluginRole.Namespace, r.pluginRole.Rules, wantRole, r.ds.Namespace)
		}
		subject := rbacv1.Subject{Kind: rbacv1.ServiceAccountKind, Name: r.pluginSA.Name, Namespace: r.pluginSA.Namespace}
		if r.pluginRB.RoleRef != (rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: r.pluginRole.Name}) ||
			!reflect.DeepEqual(r.pluginRB.Subjects, []rbacv1.Subject{subject}) || r.pluginRB.Namespace != r.pluginRole.Namespace {
			t.Errorf("plugin RoleBinding %+v does not bind Role %s to %+v", r.pluginRB, r.pluginRole.Name, subject)
		}
	}
	if o.pluginSA.AutomountServiceAccountToken == nil || *o.pluginSA.AutomountServiceAccountToken {
		t.Errorf("plugin ServiceAccount mounts its token into pods")
	}
}

// The shipped manifest applies cleanly (server-side dry run) in its
// namespace, and so does the chart with every value set.
func TestManifestDryRun(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	env.CreateNamespace(t, namespace, nil)
	if err := env.ApplyDryRun(ctx, readManifest(t)); err != nil {
		t.Errorf("shipped manifest: %v", err)
	}
	ns := env.CreateNamespace(t, "", nil).Name
	// The Prometheus Operator's kinds have no CRDs in this API server:
	// monitoring_test.go checks those objects with promtool.
	if err := env.ApplyDryRun(ctx, withoutMonitoring(t, render(t, "all", ns, "-f", allValues))); err != nil {
		t.Errorf("all values: %v", err)
	}
}

// Applied for real, the chart's own bindings give its ServiceAccount what
// the agent needs and nothing beyond: of DaemonSets, its own by name and a
// list of its namespace's, no watch; of Services, the release's signal by
// name.
func TestChartBindingsGrantTheAgent(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	ns := env.CreateNamespace(t, "", nil).Name
	name := testnet.RandName("agent-", 6)
	if _, err := env.Apply(ctx, render(t, name, ns, "--set", "nameOverride="+name), kubeenv.ApplyOptions{Namespace: ns}); err != nil {
		t.Fatal(err)
	}
	allowed := accessOf(t, env, ns, name)
	signal := "ambient-cni-" + name + "-installed"
	grant := []authorizationv1.ResourceAttributes{
		{Verb: "list", Resource: "pods"},
		{Verb: "watch", Resource: "pods"},
		{Verb: "patch", Resource: "pods", Subresource: "status", Namespace: "default", Name: "p"},
		{Verb: "watch", Resource: "namespaces"},
		{Verb: "create", Resource: "events", Namespace: "default"},
		{Verb: "patch", Resource: "events", Namespace: "default"},
		{Verb: "get", Group: "apps", Resource: "daemonsets", Namespace: ns, Name: name},
		{Verb: "list", Group: "apps", Resource: "daemonsets", Namespace: ns},
		{Verb: "watch", Resource: "services", Namespace: ns, Name: signal},
		{Verb: "list", Resource: "services", Namespace: ns, Name: signal},
		{Verb: "get", Resource: "nodes", Name: "some-node"},
	}
	// The RBAC authorizer sees new bindings through a watch: wait for them.
	deadline := time.Now().Add(30 * time.Second)
	for _, a := range grant {
		var ok bool
		var err error
		if poll.Wait(ctx, time.Until(deadline), func() bool { ok, err = allowed(a); return ok }) != nil {
			t.Fatalf("%+v never allowed (last error %v)", a, err)
		}
	}
	deny := []authorizationv1.ResourceAttributes{
		{Verb: "get", Group: "apps", Resource: "daemonsets", Namespace: ns, Name: "ztunnel"},
		{Verb: "get", Group: "apps", Resource: "daemonsets", Namespace: "default", Name: name},
		{Verb: "list", Group: "apps", Resource: "daemonsets", Namespace: "default"},
		{Verb: "watch", Group: "apps", Resource: "daemonsets", Namespace: ns},
		{Verb: "watch", Resource: "services", Namespace: ns},
		{Verb: "get", Resource: "services", Namespace: ns, Name: "kubernetes"},
		{Verb: "delete", Resource: "services", Namespace: ns, Name: signal},
		{Verb: "update", Resource: "pods", Namespace: "default", Name: "p"},
		{Verb: "delete", Resource: "pods", Namespace: "default", Name: "p"},
		{Verb: "list", Resource: "secrets"},
		{Verb: "list", Resource: "nodes"},
		{Verb: "patch", Resource: "nodes", Name: "some-node"},
		{Verb: "patch", Resource: "namespaces", Name: "default"},
		{Verb: "create", Group: "events.k8s.io", Resource: "events", Namespace: "default"},
	}
	for _, a := range deny {
		if ok, err := allowed(a); ok || err != nil {
			t.Errorf("%+v: allowed=%v err=%v, want denied", a, ok, err)
		}
	}

	// The plugin's own ServiceAccount: the pod and its namespace, the node
	// and the agent's DaemonSet by name, read only.
	plugin := accessOf(t, env, ns, name+"-plugin")
	for _, a := range []authorizationv1.ResourceAttributes{
		{Verb: "get", Resource: "pods", Namespace: "default", Name: "p"},
		{Verb: "get", Resource: "namespaces", Name: "default"},
		{Verb: "get", Resource: "nodes", Name: "some-node"},
		{Verb: "get", Group: "apps", Resource: "daemonsets", Namespace: ns, Name: name},
	} {
		var ok bool
		var err error
		if poll.Wait(ctx, time.Until(deadline.Add(30*time.Second)), func() bool { ok, err = plugin(a); return ok }) != nil {
			t.Fatalf("plugin: %+v never allowed (last error %v)", a, err)
		}
	}
	for _, a := range []authorizationv1.ResourceAttributes{
		{Verb: "list", Resource: "pods"},
		{Verb: "list", Resource: "nodes"},
		{Verb: "watch", Resource: "nodes"},
		{Verb: "patch", Resource: "nodes", Name: "some-node"},
		{Verb: "list", Group: "apps", Resource: "daemonsets", Namespace: ns},
		{Verb: "watch", Group: "apps", Resource: "daemonsets", Namespace: ns, Name: name},
		{Verb: "get", Group: "apps", Resource: "daemonsets", Namespace: ns, Name: "ztunnel"},
		{Verb: "get", Group: "apps", Resource: "daemonsets", Namespace: "default", Name: name},
		{Verb: "patch", Group: "apps", Resource: "daemonsets", Namespace: ns, Name: name},
		{Verb: "get", Resource: "secrets", Namespace: ns, Name: "s"},
		{Verb: "create", Resource: "serviceaccounts", Subresource: "token", Namespace: ns, Name: name + "-plugin"},
	} {
		if ok, err := plugin(a); ok || err != nil {
			t.Errorf("plugin: %+v: allowed=%v err=%v, want denied", a, ok, err)
		}
	}
}

// accessOf returns a check of what ServiceAccount ns/name may do, asked
// with a token of its own.
func accessOf(t *testing.T, env *kubeenv.Env, ns, name string) func(authorizationv1.ResourceAttributes) (bool, error) {
	t.Helper()
	ctx := context.Background()
	tr, err := env.Client.CoreV1().ServiceAccounts(ns).CreateToken(ctx, name, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: new(int64(600))},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := &rest.Config{Host: env.Config.Host, TLSClientConfig: rest.TLSClientConfig{CAData: env.Config.CAData}, BearerToken: tr.Status.Token}
	sa, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return func(a authorizationv1.ResourceAttributes) (bool, error) {
		r, err := sa.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{
			Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &a},
		}, metav1.CreateOptions{})
		if err != nil {
			return false, err
		}
		return r.Status.Allowed, nil
	}
}
