//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/realnode/podapp"
)

// User-namespaced pods (hostUsers: false, GA in Kubernetes 1.36), on a
// node of their own whose containerd 2.x runs the runc built into the
// tools cache: Debian's runc 1.1.5 reports no idmapped mounts in `runc
// features`, so containerd reports no user namespace support for the
// handler and kubelet refuses every such pod. The capture rules key on
// packet marks, not uids; the agent reads such a pod's /proc/net files,
// which belong to the pod's own root (a high host uid), with
// CAP_DAC_READ_SEARCH.
func TestRealNodeUserNamespaces(t *testing.T) {
	testnet.RequireRoot(t)
	runc, err := RecentRunc()
	if err != nil {
		testnet.Missing(t, fmt.Sprintf("runc for user-namespaced pods: %v; build it with %s", err, BuildCommand))
	}
	e := startAgentNodeWith(t, Options{Runc: runc})
	t.Run("containerd reports user namespace support for its runc handler", e.testRuntimeUserns)
	t.Run("user-namespaced pods are captured at ADD and by enrollment, proxied, released", e.testUserNamespacedPods)
	t.Run("nothing was sent off the machine", testNoEgress(e.n))
}

// testRuntimeUserns: kubelet admits a hostUsers: false pod only on a
// handler whose features say user namespaces, which containerd derives
// from the runtime's `runc features` (user namespaces and idmap mounts).
func (e *e2e) testRuntimeUserns(t *testing.T) {
	ok, err := e.runtimeUserns(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		t.Fatal("containerd reports no runtime handler with user namespace support")
	}
}

// runtimeUserns reports whether containerd says any runtime handler
// supports user namespaces.
func (e *e2e) runtimeUserns(ctx context.Context) (bool, error) {
	info, err := e.runtimeInfo(ctx)
	if err != nil {
		return false, err
	}
	for _, h := range info.RuntimeHandlers {
		if h.Features["userNamespaces"] == true || h.Features["user_namespaces"] == true {
			return true, nil
		}
	}
	return false, nil
}

// usernsPod starts an app pod with hostUsers: false and waits until it is
// Ready.
func (e *e2e) usernsPod(t *testing.T, ns, name string, o AppOptions) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	pod := e.n.AppPod(ns, name, o)
	hostUsers := false
	pod.Spec.HostUsers = &hostUsers
	if _, err := e.n.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	p, err := e.n.WaitPodReady(ctx, ns, name)
	if err != nil {
		e.logWhy(t, ns, name)
		t.Fatal(err)
	}
	return p
}

// logWhy logs a pod's events and the lines of containerd's log that name
// an error, for a pod that did not start.
func (e *e2e) logWhy(t *testing.T, ns, name string) {
	t.Helper()
	if evs, err := e.n.PodEvents(context.Background(), ns, name); err == nil {
		for _, ev := range evs {
			t.Logf("event %s: %s", ev.Reason, ev.Message)
		}
	}
	b, err := os.ReadFile(filepath.Join(e.n.Dir, "containerd.log"))
	if err != nil {
		t.Log(err)
		return
	}
	var errs []string
	for line := range strings.SplitSeq(string(b), "\n") {
		if strings.Contains(line, "level=error") {
			errs = append(errs, line)
		}
	}
	t.Logf("containerd's last errors:\n%s", strings.Join(errs[max(0, len(errs)-8):], "\n"))
}

// mustOwnUserns fails unless the pod's container runs in a user namespace
// of its own: uid 0 inside is a high uid on the host.
func (e *e2e) mustOwnUserns(t *testing.T, p *corev1.Pod) {
	t.Helper()
	pid := e.containerPID(t, p.Namespace, p.Name)
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/uid_map", pid))
	if err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(string(b))
	if len(f) < 3 || f[0] != "0" {
		t.Fatalf("%s/%s uid_map %q", p.Namespace, p.Name, b)
	}
	if host, err := strconv.ParseUint(f[1], 10, 32); err != nil || host == 0 {
		t.Fatalf("%s/%s runs with the host's uids (uid_map %q)", p.Namespace, p.Name, b)
	}
	self, err1 := os.Readlink("/proc/self/ns/user")
	its, err2 := os.Readlink(fmt.Sprintf("/proc/%d/ns/user", pid))
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	if self == its {
		t.Fatalf("%s/%s shares the host's user namespace", p.Namespace, p.Name)
	}
	t.Logf("%s/%s: container uid 0 is host uid %s (%s)", p.Namespace, p.Name, f[1], its)
}

func (e *e2e) mustReleased(t *testing.T, p *corev1.Pod) {
	t.Helper()
	if err := e.n.Poll(context.Background(), p.Name+" released", func(ctx context.Context) (bool, error) { return e.n.released(ctx, p) }); err != nil {
		t.Fatalf("%s/%s: %v", p.Namespace, p.Name, err)
	}
}

// fetchThroughStandIn makes from GET to's app with a unique path and
// proves the connection went out of from through the stand-in's 15001 and
// into to through its 15008, and that to saw its own address (delivered
// by the stand-in inside it).
func (e *e2e) fetchThroughStandIn(t *testing.T, from, to *corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	marker := "/userns-" + randHex(4) + "-" + from.Name + "-to-" + to.Name
	body, err := httpGet(ctx, appURL(from, "/fetch?url="+url.QueryEscape(appURL(to, marker))))
	if err != nil {
		t.Fatal(err)
	}
	var res podapp.FetchResult
	if err := json.Unmarshal(body, &res); err != nil {
		t.Fatal(err)
	}
	if res.Err != "" || res.Status != 200 {
		t.Fatalf("%s → %s: status %d err %q", from.Name, to.Name, res.Status, res.Err)
	}
	e.mustProxied(t, from.UID, to, ambient.ZtunnelOutboundPort)
	e.mustProxied(t, to.UID, to, ambient.ZtunnelInboundHBONEPort)
	src, err := seenFrom(ctx, to, marker)
	if err != nil {
		t.Fatal(err)
	}
	if src.String() != to.Status.PodIP {
		t.Errorf("%s saw %s from %s: it bypassed the stand-in", to.Name, marker, src)
	}
}

// mustProxied waits for a stand-in record of uid on port towards to's app.
func (e *e2e) mustProxied(t *testing.T, uid types.UID, to *corev1.Pod, port int) {
	t.Helper()
	dst := netip.AddrPortFrom(netip.MustParseAddr(to.Status.PodIP), AppPort)
	err := e.n.Poll(context.Background(), fmt.Sprintf("stand-in record of %s on %d to %s", uid, port, dst), func(context.Context) (bool, error) {
		if len(e.records(t, uid, port, dst)) == 0 {
			return false, fmt.Errorf("no record of %s on %d to %s", uid, port, dst)
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// labelNamespace sets (value non-empty) or removes the dataplane-mode label.
func (e *e2e) labelNamespace(t *testing.T, ns, value string) {
	t.Helper()
	v := "null"
	if value != "" {
		v = strconv.Quote(value)
	}
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%s}}}`, ambient.DataplaneModeLabel, v)
	if _, err := e.n.Client.CoreV1().Namespaces().Patch(context.Background(), ns, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
}

// testUserNamespacedPods: a hostUsers: false pod of an ambient namespace
// is captured at ADD (its first connection, made at start, goes through
// the stand-in); one started outside the mesh is enrolled when its
// namespace is labelled; both carry traffic through the stand-in; the
// label's removal releases one and the deletion of the other leaves no
// trace in the agent, the stand-in or the probe set.
func (e *e2e) testUserNamespacedPods(t *testing.T) {
	ctx := context.Background()
	suffix := randHex(4)
	mesh, late := "userns-mesh-"+suffix, "userns-late-"+suffix
	e.namespace(t, mesh, true)
	e.namespace(t, late, false)

	srv := e.usernsPod(t, mesh, "srv", AppOptions{})
	e.mustOwnUserns(t, srv)
	e.mustCaptured(t, srv)

	hello := "/hello-from-cli"
	cli := e.usernsPod(t, mesh, "cli", AppOptions{Hello: appURL(srv, hello)})
	e.mustOwnUserns(t, cli)
	e.mustCaptured(t, cli)
	// Captured at ADD: the app's first act, before any agent could have
	// enrolled a running pod, went out through the stand-in.
	e.mustProxied(t, cli.UID, srv, ambient.ZtunnelOutboundPort)
	if src, err := seenFrom(ctx, srv, hello); err != nil || src.String() != srv.Status.PodIP {
		t.Errorf("srv saw cli's hello from %v (%v): it bypassed the stand-in", src, err)
	}
	e.fetchThroughStandIn(t, cli, srv)
	e.fetchThroughStandIn(t, srv, cli)

	// Enrollment: a running user-namespaced pod whose namespace joins.
	run := e.usernsPod(t, late, "running", AppOptions{})
	e.mustOwnUserns(t, run)
	e.mustReleased(t, run)
	e.labelNamespace(t, late, ambient.DataplaneModeAmbient)
	e.mustCaptured(t, run)
	e.fetchThroughStandIn(t, run, srv)
	e.fetchThroughStandIn(t, cli, run)

	// Release: the label goes, then a captured pod is deleted.
	e.labelNamespace(t, late, "")
	e.mustReleased(t, run)
	if err := e.n.Client.CoreV1().Pods(mesh).Delete(ctx, srv.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := e.n.WaitPodGone(ctx, mesh, srv.Name); err != nil {
		t.Fatal(err)
	}
	e.agentForgot(t, srv.UID, srv.Status.PodIP)
}
