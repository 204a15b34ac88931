package kubeenv

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

var kube Shared

func TestMain(m *testing.M) { os.Exit(kube.Run(m)) }

// The Go side and the build script must agree on where binaries live, or
// tests would skip (or fail in CI) right after `make tools`.
func TestToolPathsMatchScript(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{Etcd, KubeAPIServer, Kubelet, Helm, Promtool, Prometheus} {
		out, err := exec.Command("bash", filepath.Join(root, "hack", "kube-tools.sh"), "--path", name).Output()
		if err != nil {
			t.Fatalf("kube-tools.sh --path %s: %v", name, err)
		}
		want, err := ToolCachePath(name)
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimSpace(string(out)); got != want {
			t.Errorf("%s: script says %s, Go says %s", name, got, want)
		}
	}
}

func TestToolPathOverrideAndMissing(t *testing.T) {
	t.Setenv(toolEnv(Helm), filepath.Join(t.TempDir(), "nope"))
	if _, err := ToolPath(Helm); err == nil || !strings.Contains(err.Error(), "make tools") {
		t.Fatalf("missing override: want an error naming the build command, got %v", err)
	}
	if _, err := ToolPath("kubectl"); err == nil {
		t.Fatal("unknown tool: want an error")
	}
}

func TestStartsRealAPIServer(t *testing.T) {
	env := kube.Env(t)
	v, err := env.Client.Discovery().ServerVersion()
	if err != nil {
		t.Fatal(err)
	}
	want, err := ToolVersion(KubeAPIServer)
	if err != nil {
		t.Fatal(err)
	}
	if v.GitVersion != want {
		t.Errorf("server version %q, want %q (version stamp missing?)", v.GitVersion, want)
	}
	ctx := context.Background()
	for _, ns := range []string{"default", "kube-system"} {
		if _, err := env.Client.CoreV1().Namespaces().Get(ctx, ns, metav1.GetOptions{}); err != nil {
			t.Errorf("namespace %s: %v", ns, err)
		}
	}
	// The admin is who we think it is.
	r, err := env.Client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(r.Status.UserInfo.Groups, "system:masters") {
		t.Errorf("admin groups %v lack system:masters", r.Status.UserInfo.Groups)
	}
	t.Logf("kube-apiserver %s, started in %v", v.GitVersion, env.StartTime)
}

func TestCreateNamespaceAllowsPods(t *testing.T) {
	env := kube.Env(t)
	ns := env.CreateNamespace(t, "", map[string]string{"istio.io/dataplane-mode": "ambient"})
	ctx := context.Background()
	got, err := env.Client.CoreV1().Namespaces().Get(ctx, ns.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Labels["istio.io/dataplane-mode"] != "ambient" {
		t.Errorf("labels %v", got.Labels)
	}
	// Pods need the default ServiceAccount (admission) but no scheduler
	// when nodeName is set.
	if _, err := env.Client.CoreV1().Pods(ns.Name).Create(ctx, testPod("p1"), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create pod: %v", err)
	}
}

func testPod(name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: corev1.PodSpec{
			NodeName:                     "node-a",
			AutomountServiceAccountToken: new(false),
			Containers:                   []corev1.Container{{Name: "app", Image: "docker.io/local/app:1"}},
		},
	}
}

// The agent's permissions are the shipped manifest's, no more: what it needs
// works, and what it must not do is Forbidden.
func TestServiceAccountClientHasExactlyShippedRBAC(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	agentNS := env.CreateNamespace(t, "", nil).Name
	appNS := env.CreateNamespace(t, "", nil).Name
	if _, err := env.Client.CoreV1().Pods(appNS).Create(ctx, testPod("app"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	_, sa := env.ServiceAccountClient(t, agentNS, "ambient-cni", ShippedRBAC(t))

	r, err := sa.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if want := "system:serviceaccount:" + agentNS + ":ambient-cni"; r.Status.UserInfo.Username != want {
		t.Fatalf("authenticated as %q, want %q", r.Status.UserInfo.Username, want)
	}

	allowed := map[string]func() error{
		"list pods on a node": func() error {
			_, err := sa.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=node-a"})
			return err
		},
		"watch pods": func() error {
			w, err := sa.CoreV1().Pods("").Watch(ctx, metav1.ListOptions{})
			if err == nil {
				w.Stop()
			}
			return err
		},
		"list namespaces": func() error {
			_, err := sa.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
			return err
		},
		"merge-patch pods/status": func() error {
			patch := []byte(`{"metadata":{"annotations":{"ambient.istio.io/redirection":"enabled"}}}`)
			_, err := sa.CoreV1().Pods(appNS).Patch(ctx, "app", types.MergePatchType, patch, metav1.PatchOptions{}, "status")
			return err
		},
		"create events": func() error {
			_, err := sa.CoreV1().Events(appNS).Create(ctx, &corev1.Event{
				ObjectMeta:     metav1.ObjectMeta{GenerateName: "app."},
				InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: appNS, Name: "app"},
				Reason:         "Test", Message: "m", Type: corev1.EventTypeNormal,
			}, metav1.CreateOptions{})
			return err
		},
		"list and watch the release's signal by name": func() error {
			byName := metav1.ListOptions{FieldSelector: "metadata.name=ambient-cni-installed"}
			if _, err := sa.CoreV1().Services(agentNS).List(ctx, byName); err != nil {
				return err
			}
			w, err := sa.CoreV1().Services(agentNS).Watch(ctx, byName)
			if err == nil {
				w.Stop()
			}
			return err
		},
		"get its node (NotFound, not Forbidden)": func() error {
			_, err := sa.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return nil
			}
			return err
		},
		"list the chart's daemonsets by label": func() error {
			byLabel := metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ambient-cni"}
			_, err := sa.AppsV1().DaemonSets(agentNS).List(ctx, byLabel)
			return err
		},
		"get own daemonset (NotFound, not Forbidden)": func() error {
			_, err := sa.AppsV1().DaemonSets(agentNS).Get(ctx, "ambient-cni", metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return nil
			}
			return err
		},
	}
	for what, f := range allowed {
		if err := f(); err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}

	forbidden := map[string]func() error{
		"delete pods": func() error {
			return sa.CoreV1().Pods(appNS).Delete(ctx, "app", metav1.DeleteOptions{})
		},
		"update pod spec (patch without status)": func() error {
			_, err := sa.CoreV1().Pods(appNS).Patch(ctx, "app", types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{})
			return err
		},
		"list secrets": func() error {
			_, err := sa.CoreV1().Secrets("").List(ctx, metav1.ListOptions{})
			return err
		},
		"watch daemonsets (each status write would reach every agent)": func() error {
			w, err := sa.AppsV1().DaemonSets(agentNS).Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=ambient-cni"})
			if err == nil {
				w.Stop()
			}
			return err
		},
		"list services but the release's signal": func() error {
			_, err := sa.CoreV1().Services(agentNS).List(ctx, metav1.ListOptions{})
			return err
		},
		"list nodes": func() error {
			_, err := sa.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
			return err
		},
		"patch nodes": func() error {
			_, err := sa.CoreV1().Nodes().Patch(ctx, "node-a", types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{})
			return err
		},
		"patch namespaces": func() error {
			_, err := sa.CoreV1().Namespaces().Patch(ctx, appNS, types.MergePatchType, []byte(`{"metadata":{"labels":{"x":"y"}}}`), metav1.PatchOptions{})
			return err
		},
		"get another daemonset in its namespace": func() error {
			_, err := sa.AppsV1().DaemonSets(agentNS).Get(ctx, "ztunnel", metav1.GetOptions{})
			return err
		},
		"create events.k8s.io events": func() error {
			_, err := sa.EventsV1().Events(appNS).Create(ctx, &eventsv1.Event{
				ObjectMeta: metav1.ObjectMeta{GenerateName: "app."},
				EventTime:  metav1.NowMicro(), ReportingController: "ambient-cni", ReportingInstance: "x",
				Action: "Test", Reason: "Test", Type: corev1.EventTypeNormal,
				Regarding: corev1.ObjectReference{Kind: "Pod", Namespace: appNS, Name: "app"},
			}, metav1.CreateOptions{})
			return err
		},
		"get daemonsets outside its namespace": func() error {
			_, err := sa.AppsV1().DaemonSets("kube-system").Get(ctx, "ambient-cni", metav1.GetOptions{})
			return err
		},
		"create pods": func() error {
			p := testPod("intruder")
			_, err := sa.CoreV1().Pods(appNS).Create(ctx, p, metav1.CreateOptions{})
			return err
		},
	}
	for what, f := range forbidden {
		if err := f(); !apierrors.IsForbidden(err) {
			t.Errorf("%s: want Forbidden, got %v", what, err)
		}
	}
}

// The shipped manifest grants exactly the rules issue 5 allows; a drift
// here must be a deliberate change to this test too.
func TestShippedRBACRules(t *testing.T) {
	objs, err := ParseObjects(ShippedRBAC(t))
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if k := o.GetKind(); k != "ClusterRole" && k != "Role" {
			t.Errorf("unexpected %s in shipped RBAC", k)
		}
		if ns := o.GetNamespace(); ns != "" {
			t.Errorf("%s %s keeps namespace %q; ServiceAccountClient must place it", o.GetKind(), o.GetName(), ns)
		}
	}
	cluster, namespaced, err := RoleRules(ShippedRBAC(t))
	if err != nil {
		t.Fatal(err)
	}
	type rule struct{ scope, group, resource, names, verbs string }
	var got []rule
	for scope, rules := range map[string][]rbacv1.PolicyRule{"cluster": cluster, "namespace": namespaced} {
		for _, r := range rules {
			if len(r.NonResourceURLs) > 0 {
				t.Errorf("unexpected rule shape %+v", r)
			}
			for _, g := range r.APIGroups {
				for _, res := range r.Resources {
					got = append(got, rule{scope, g, res, strings.Join(r.ResourceNames, ","), strings.Join(r.Verbs, ",")})
				}
			}
		}
	}
	want := []rule{
		{"cluster", "", "pods", "", "get,list,watch"},
		{"cluster", "", "pods/status", "", "patch"},
		{"cluster", "", "namespaces", "", "get,list,watch"},
		{"cluster", "", "events", "", "create,patch"},
		// Its own Node, read at shutdown (no per-node name in RBAC).
		{"cluster", "", "nodes", "", "get"},
		// Its own DaemonSet read by name (the default release's name);
		// the DaemonSets of its namespace listed (the chart's others, by
		// label: a rename is no uninstall), never watched.
		{"namespace", "apps", "daemonsets", "ambient-cni", "get"},
		{"namespace", "apps", "daemonsets", "", "list"},
		// The release's signal, by name: its deletion is an uninstall.
		{"namespace", "", "services", "ambient-cni-installed", "get,list,watch"},
		// Tokens of the plugin's own ServiceAccount only (its credential
		// for when the agent cannot answer).
		{"namespace", "", "serviceaccounts/token", "ambient-cni-plugin", "create"},
	}
	sortRules := func(a, b rule) int { return strings.Compare(fmt.Sprint(a), fmt.Sprint(b)) }
	slices.SortFunc(got, sortRules)
	slices.SortFunc(want, sortRules)
	if !slices.Equal(got, want) {
		t.Errorf("shipped RBAC rules\n got %v\nwant %v", got, want)
	}
}

// ExtractRoles keeps roles only, strips Role namespaces, and refuses a
// manifest that grants nothing cluster-wide.
func TestExtractRoles(t *testing.T) {
	manifest := `
apiVersion: v1
kind: ServiceAccount
metadata: {name: sa, namespace: ns1}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: cr}
rules: [{apiGroups: [""], resources: [pods], verbs: [get]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: crb}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: cr}
subjects: [{kind: ServiceAccount, name: sa, namespace: ns1}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: r, namespace: ns1}
rules: [{apiGroups: [apps], resources: [daemonsets], resourceNames: [ds], verbs: [get]}]
`
	out, err := ExtractRoles([]byte(manifest))
	if err != nil {
		t.Fatal(err)
	}
	objs, err := ParseObjects(out)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, o := range objs {
		got = append(got, o.GetKind()+"/"+o.GetNamespace()+"/"+o.GetName())
	}
	if want := []string{"ClusterRole//cr", "Role//r"}; !slices.Equal(got, want) {
		t.Errorf("extracted %v, want %v", got, want)
	}
	_, namespaced, err := RoleRules(out)
	if err != nil || len(namespaced) != 1 || !slices.Equal(namespaced[0].ResourceNames, []string{"ds"}) {
		t.Errorf("role rules %+v (err %v): resourceNames lost", namespaced, err)
	}
	for name, bad := range map[string]string{
		"no clusterrole": "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: sa}\n",
		"not yaml":       "{[",
	} {
		if _, err := ExtractRoles([]byte(bad)); err == nil {
			t.Errorf("%s: want an error", name)
		}
	}
}

const dryRunManifest = `
apiVersion: v1
kind: ServiceAccount
metadata:
  name: dry-agent
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: kubeenv-dry-run
rules:
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["get"]
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: dry-agent
spec:
  selector:
    matchLabels: {app: dry-agent}
  template:
    metadata:
      labels: {app: dry-agent}
    spec:
      hostNetwork: true
      priorityClassName: system-node-critical
      serviceAccountName: dry-agent
      tolerations: [{operator: Exists}]
      containers:
        - name: agent
          image: docker.io/local/agent:1
          securityContext:
            privileged: true
            capabilities: {add: [NET_ADMIN, NET_RAW, SYS_ADMIN, SYS_PTRACE], drop: [ALL]}
          volumeMounts: [{name: proc, mountPath: /host/proc, readOnly: true}]
      volumes:
        - name: proc
          hostPath: {path: /proc}
`

func TestApplyDryRun(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	if err := env.ApplyDryRun(ctx, []byte(dryRunManifest)); err != nil {
		t.Fatalf("dry-run apply of a valid manifest: %v", err)
	}
	// Dry run persisted nothing.
	if _, err := env.Client.AppsV1().DaemonSets("default").Get(ctx, "dry-agent", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("daemonset after dry run: want NotFound, got %v", err)
	}
	if _, err := env.Client.RbacV1().ClusterRoles().Get(ctx, "kubeenv-dry-run", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("clusterrole after dry run: want NotFound, got %v", err)
	}

	// The server, not a client-side check, rejects what a cluster would.
	for name, c := range map[string]struct{ manifest, want string }{
		"invalid field value": {strings.Replace(dryRunManifest, "operator: Exists", "operator: Sometimes", 1), "Unsupported value"},
		"missing image":       {strings.Replace(dryRunManifest, "image: docker.io/local/agent:1", "", 1), "image: Required value"},
		"unknown kind":        {"apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n", "no matches for kind"},
		"missing namespace":   {"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c, namespace: no-such-ns}\n", "not found"},
		"not yaml":            {"{[", "decode manifest"},
	} {
		err := env.ApplyDryRun(ctx, []byte(c.manifest))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: want an error containing %q, got %v", name, c.want, err)
		}
	}
}

func TestApplyAndKubeconfig(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	ns := env.CreateNamespace(t, "", nil).Name
	cm := "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {k: v}\n"
	if _, err := env.Apply(ctx, []byte(cm), ApplyOptions{Namespace: ns}); err != nil {
		t.Fatal(err)
	}
	// A kubeconfig file for a separate process reaches the same server.
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := WriteKubeconfig(env.Config, path); err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	got, err := cs.CoreV1().ConfigMaps(ns).Get(ctx, "c", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Data["k"] != "v" {
		b, _ := json.Marshal(got)
		t.Errorf("configmap %s", b)
	}
}

// A node identity from UserConfig is governed by the Node authorizer: it
// may read its own Node but not another's.
func TestUserConfigNodeIdentity(t *testing.T) {
	env := kube.Env(t)
	ctx := context.Background()
	node := testnet.RandName("node-", 6)
	for _, n := range []string{node, node + "-other"} {
		if _, err := env.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := env.UserConfig("system:node:"+node, "system:nodes")
	if err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{}); err != nil {
		t.Errorf("node reads itself: %v", err)
	}
	if _, err := cs.CoreV1().Secrets("default").List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("node lists secrets: want Forbidden, got %v", err)
	}
}

// A per-test Env leaves no process behind when its test ends.
func TestStartStopsWithTest(t *testing.T) {
	var pids []int
	t.Run("env", func(t *testing.T) {
		env := Start(t)
		if _, err := env.Client.CoreV1().Namespaces().List(context.Background(), metav1.ListOptions{}); err != nil {
			t.Fatal(err)
		}
		pids = []int{env.etcd.Pid(), env.apiserver.Pid()}
	})
	if len(pids) == 0 {
		t.Skip("env did not start")
	}
	for _, pid := range pids {
		if err := syscall.Kill(pid, 0); err != syscall.ESRCH {
			t.Errorf("pid %d still exists after the test ended (kill 0: %v)", pid, err)
		}
	}
}
