package chaos

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The checks of an uninstall cut short by a SIGKILL.
const (
	checkChainedHasMarker = "a plugin left chained has the uninstall marker beside it"
	checkPodsStart        = "pods start after the kill"
)

// uninstallPending: the plugin's side of the marker (it lets every pod
// through while no agent answers) is made on another branch.
var uninstallPending = pending{
	checkPodsStart: "the plugin honouring the uninstall marker (branch h27-plugin)",
}

// uninstallStep is a point of the agent's uninstall to kill it at: when
// its log line appears after SIGTERM (at once when it has none), then a
// random jitter below jitter; or, with noSignal, before any SIGTERM.
type uninstallStep struct {
	name, line string
	jitter     time.Duration
	noSignal   bool
}

// uninstallSteps follow the uninstall's order (see install-cni's
// daemonSetChanged and its uninstall's list of steps): the marker written when the
// DaemonSet is seen being deleted, the SIGTERM and the unchaining, the
// pods' release, the end; and a random moment.
var uninstallSteps = []uninstallStep{
	{name: "marked", noSignal: true},
	{name: "signal", jitter: 3 * time.Millisecond},
	{name: "unchained", line: "uninstall: plugin unchained", jitter: 5 * time.Millisecond},
	{name: "released", line: "released every pod for the uninstall", jitter: 5 * time.Millisecond},
	{name: "stopped", line: "install-cni stopped"},
	{name: "anytime", jitter: time.Second},
}

// TestUninstallKilled: helm uninstall's order (the DaemonSet deleted in
// the foreground, then the agent SIGTERMed), with the agent SIGKILLed at
// each step of its uninstall in turn (and at a random moment), jittered
// by the seed. Whatever the point, the node is left where pods can start:
// no agent comes back (the DaemonSet is going), and a plain pod and a pod
// of an ambient namespace both start through the real CNI chain within
// the runtime's retries. A plugin still chained always has the uninstall
// marker beside it.
func TestUninstallKilled(t *testing.T) {
	requireLong(t)
	seeds := chaosSeeds(t)
	for i, seed := range seeds {
		for j, step := range uninstallSteps {
			subnet := netip.PrefixFrom(netip.AddrFrom4([4]byte{10, byte(130 + (i*len(uninstallSteps)+j)%60), 0, 0}), 16)
			t.Run(fmt.Sprintf("seed=%d/%s", seed, step.name), func(t *testing.T) {
				t.Logf("seed %d (replay: %s=%d)", seed, seedsEnv, seed)
				uninstallKillRun(t, rand.New(rand.NewPCG(seed, uint64(j))), step, subnet)
			})
		}
	}
}

func uninstallKillRun(t *testing.T, rng *rand.Rand, step uninstallStep, subnet netip.Prefix) {
	ns := testnet.RandName("uninst-", 6)
	n := newNode(t, nodeOptions{subnet: subnet, namespace: ns})
	w := newWorld(n)
	amb := w.namespace("amb", ambient.DataplaneModeAmbient)
	plain := w.namespace("plain", "")
	ctx := runContext(t)
	ds := n.createDaemonSet(ctx, ns)
	for i := range 3 {
		if _, err := w.run(ctx, rng, podObject(amb, "a"+strconv.Itoa(i), "")); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.run(ctx, rng, podObject(plain, "p0", "")); err != nil {
		t.Fatal(err)
	}

	// helm uninstall's hook: the release's signal deleted, the DaemonSet
	// deleted in the foreground (held "being deleted" here: no garbage
	// collector runs), then the agent's pod is deleted and the agent gets
	// SIGTERM.
	if err := kubeenv.DeleteReleaseSignal(ctx, n.env.Client, ns, n.cfg.ReleaseSignal); err != nil {
		t.Fatal(err)
	}
	fg := metav1.DeletePropagationForeground
	if err := n.env.Client.AppsV1().DaemonSets(ns).Delete(ctx, ds, metav1.DeleteOptions{PropagationPolicy: &fg}); err != nil {
		t.Fatal(err)
	}
	marker := n.cfg.Layout().Uninstalling()
	waitFor(t, 30*time.Second, "the agent marking the uninstall once the release's signal is deleted", func() bool {
		_, err := os.Lstat(marker)
		return err == nil
	})
	p := n.sim.Agent()
	from := logSize(n.sim.LogPath)
	sent := time.Now()
	if step.noSignal {
		// The agent dies before its SIGTERM (an OOM kill while its pod
		// waits to be deleted): nothing of its shutdown runs.
	} else if err := p.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if step.line != "" {
		waitLogLine(t, n.sim.LogPath, from, step.line, 30*time.Second)
	}
	if step.jitter > 0 {
		time.Sleep(time.Duration(rng.Int64N(int64(step.jitter))))
	}
	exited := p.Exited()
	p.Kill()
	t.Logf("killed at step %q, %v after the SIGTERM (or the moment it would have come), had exited already: %v", step.name, time.Since(sent).Round(time.Millisecond), exited)

	r := results{}
	confPath := filepath.Join(n.sim.ConfDir, simnode.PrimaryConf)
	conf, err := os.ReadFile(confPath)
	if err != nil {
		t.Fatal(err)
	}
	chained := bytes.Contains(conf, []byte(`"`+n.cfg.PluginType+`"`))
	_, merr := os.Lstat(marker)
	t.Logf("left: plugin chained %v, uninstall marker %v", chained, merr == nil)
	if chained && merr != nil {
		r.add(checkChainedHasMarker, "the plugin is chained and no uninstall marker is there (%v)", merr)
	}

	// New pods, as the runtime starts them: with the conflist now on disk
	// (runtimes watch their config directory), retried as kubelet does,
	// for a few seconds.
	list, err := libcni.ConfListFromBytes(conf)
	if err != nil {
		t.Fatalf("the conflist left on disk does not parse: %v\n%s", err, conf)
	}
	n.kube.Conf = list
	for _, obj := range []*corev1.Pod{podObject(plain, "after", ""), podObject(amb, "after", "")} {
		created, err := n.kube.Create(ctx, obj)
		if err != nil {
			t.Fatal(err)
		}
		sctx, scancel := context.WithTimeout(ctx, 15*time.Second)
		_, failed, err := w.startSandbox(sctx, rng, created)
		scancel()
		if err != nil {
			r.add(checkPodsStart, "pod %s/%s did not start within 15s (%d ADDs failed, last: %v)", obj.Namespace, obj.Name, len(failed), err)
		} else if len(failed) > 0 {
			t.Logf("pod %s/%s started after %d failed ADDs", obj.Namespace, obj.Name, len(failed))
		}
	}
	judgeOne(t, checkChainedHasMarker, r[checkChainedHasMarker], uninstallPending)
	judgeOne(t, checkPodsStart, r[checkPodsStart], uninstallPending)
}

// createDaemonSet creates the agent's DaemonSet in ns (the name the chart
// gives it), so that the agent's stop is an uninstall only once it is
// deleted; it returns its name. Its finalizer is dropped when the test
// ends.
func (n *node) createDaemonSet(ctx context.Context, ns string) string {
	n.t.Helper()
	labels := map[string]string{"app": "ambient-cni"}
	ds := &appsv1.DaemonSet{
		ObjectMeta: metav1.ObjectMeta{Name: n.cfg.DaemonSet, Namespace: ns},
		Spec: appsv1.DaemonSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "install-cni", Image: "x"}}},
			},
		},
	}
	if _, err := n.env.Client.AppsV1().DaemonSets(ns).Create(ctx, ds, metav1.CreateOptions{}); err != nil {
		n.t.Fatalf("create daemonset: %v", err)
	}
	if err := kubeenv.CreateReleaseSignal(ctx, n.env.Client, ns, n.cfg.ReleaseSignal); err != nil {
		n.t.Fatal(err)
	}
	n.t.Cleanup(func() {
		patch := []byte(`{"metadata":{"finalizers":null}}`)
		_, _ = n.env.Client.AppsV1().DaemonSets(ns).Patch(context.Background(), ds.Name, "application/merge-patch+json", patch, metav1.PatchOptions{})
		_ = n.env.Client.AppsV1().DaemonSets(ns).Delete(context.Background(), ds.Name, metav1.DeleteOptions{})
	})
	return ds.Name
}

// waitFor polls cond every few milliseconds until it holds, or fails the
// test after within.
func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// logSize is the log's size now: where the next lines start.
func logSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// waitLogLine waits until a line containing msg is written to the log
// past offset from, reading only what is new, every millisecond (a kill
// "at" a step lands within a millisecond or two of its line).
func waitLogLine(t *testing.T, path string, from int64, msg string, within time.Duration) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.Seek(from, io.SeekStart); err != nil {
		t.Fatal(err)
	}
	var seen []byte
	buf := make([]byte, 64<<10)
	deadline := time.Now().Add(within)
	for {
		for {
			k, err := f.Read(buf)
			seen = append(seen, buf[:k]...)
			if k == 0 || err != nil {
				break
			}
		}
		if strings.Contains(string(seen), msg) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the agent never logged %q within %v of SIGTERM; it logged:\n%s", msg, within, seen)
		}
		time.Sleep(time.Millisecond)
	}
}
