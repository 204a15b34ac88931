package plugin

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
)

// The pods of the state table (docs/reliability.md): three that must be
// captured, three that must not.
type tablePod struct {
	name, ns, pod, uid string
	mustCapture        bool
}

var tablePods = []tablePod{
	{"namespace-enabled", "shop", "web-1", "uid-shop", true},
	{"pod-label-enabled", "plain", "labelled", "uid-labelled", true},
	{"namespace-labelled-during-outage", "fresh", "web-2", "uid-fresh", true},
	{"plain", "default", "app", "uid-plain", false},
	{"istio-system", "istio-system", "istiod", "uid-istiod", false},
	{"platform-system", "openshift-dns", "dns", "uid-dns", false},
}

func (p tablePod) args() string {
	return fmt.Sprintf("IgnoreUnknown=1;K8S_POD_NAMESPACE=%s;K8S_POD_NAME=%s;K8S_POD_INFRA_CONTAINER_ID=sb1;K8S_POD_UID=%s", p.ns, p.pod, p.uid)
}

// fakeAPIUp stands in for the fallback binary with the API server up: it
// answers with the enablement the cluster has now (shop and, since the
// outage, fresh are labelled ambient; pod "labelled" carries the label).
const fakeAPIUp = `#!/bin/sh
req=$(cat)
case "$req" in
*'"namespace":"shop"'*|*'"namespace":"fresh"'*) echo '{"enroll":true,"reason":"namespace labelled ambient"}';;
*'"name":"labelled"'*) echo '{"enroll":true,"reason":"pod labelled ambient"}';;
*) echo '{"enroll":false,"reason":"neither pod nor namespace labelled ambient"}';;
esac
`

// fakeAPIUpAgentGone is fakeAPIUp once the agent's DaemonSet has left
// the node: asked with checkAgent (only when a pod would wait), it says so
// for a pod that must be captured.
const fakeAPIUpAgentGone = `#!/bin/sh
req=$(cat)
gone=
case "$req" in *'"checkAgent":true'*) gone=',"agentGone":"` + agentGoneText + `"';; esac
case "$req" in
*'"namespace":"shop"'*|*'"namespace":"fresh"'*) echo '{"enroll":true,"reason":"namespace labelled ambient"'"$gone"'}';;
*'"name":"labelled"'*) echo '{"enroll":true,"reason":"pod labelled ambient"'"$gone"'}';;
*) echo '{"enroll":false,"reason":"neither pod nor namespace labelled ambient"}';;
esac
`

// agentGoneText is what the fallback binary says of a DaemonSet that left.
const agentGoneText = "the agent DaemonSet istio-system/ambient-cni no longer runs on node n1 (its nodeSelector does not match the node labels)"

// fakeAPIDown is the fallback binary with the API server unreachable.
const fakeAPIDown = "#!/bin/sh\necho 'get Pod: dial tcp 10.96.0.1:443: connect: connection refused' >&2\nexit 1\n"

// node is one node's files: the agent's run dir (tmpfs: gone after a
// reboot) and its state dir (on disk).
type node struct {
	run, state, sock string
}

func newNode(t *testing.T) node {
	t.Helper()
	root := t.TempDir()
	n := node{run: filepath.Join(root, "run"), state: filepath.Join(root, "state")}
	n.sock = filepath.Join(n.run, "agent.sock")
	for _, d := range []string{n.run, n.state} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	return n
}

func (n node) layout() nodefiles.Layout { return nodefiles.ForSocket(n.sock).WithStateDir(n.state) }

func (n node) fallback(t *testing.T, script string) {
	t.Helper()
	if err := os.WriteFile(n.layout().FallbackBinary(), []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
}

// snapshot writes the persistent snapshot the agent left before the
// outage: shop enabled, default and istio-system seen, the agent's pods of
// this node by UID (web-1 of shop captured; app of default, and labelled
// and web-2 of the namespaces labelled only during the outage, not).
func (n node) snapshot(t *testing.T, written time.Time) {
	t.Helper()
	s := &nodefiles.EnablementSnapshot{Generation: 3, EnabledNamespaces: []string{"shop"},
		Namespaces:         []string{"default", "istio-system", "kube-system", "plain", "shop"},
		ExcludedNamespaces: []string{"kube-system"},
		Pods:               map[string]bool{"uid-shop": true, "uid-plain": false, "uid-labelled": false, "uid-fresh": false},
		Written:            written}
	if err := nodefiles.WriteSnapshot(n.layout().StateSnapshot(), s); err != nil {
		t.Fatal(err)
	}
}

func (n node) conf(extra string) []byte {
	return conf(n.sock, "1.0.0", fmt.Sprintf(`,"stateDir":%q,"controlPlaneNamespaces":["ambient-cni","istio-system","openshift-*"]%s`, n.state, extra))
}

// hungAgent accepts on the socket and never answers.
func hungAgent(t *testing.T, sock string) {
	t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(io.Discard, c) }()
		}
	}()
}

// staleSocket leaves a socket file nobody listens on: a crashed agent.
func staleSocket(t *testing.T, sock string) {
	t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	_ = ln.Close()
}

// outcome is what the table expects for a pod: "start" (uncaptured, as
// it must be) or "wait" (code 11 until the agent answers).
func startOrWait(pass bool) string {
	if pass {
		return "start"
	}
	return "wait"
}

// TestStatesWithoutAgent is the state table of docs/reliability.md
// through the plugin, with real files and sockets: in every state the
// agent cannot answer, a pod that must be captured waits (code 11) and
// never starts; a pod that must not be captured starts at once, unless
// neither the API server nor the snapshot can vouch for it (then it waits,
// as under istio-cni, whose plugin fails every pod without the API
// server); the control plane's namespaces never wait.
func TestStatesWithoutAgent(t *testing.T) {
	// want: for each pod of tablePods, "start" or "wait".
	apiUp := map[string]string{"namespace-enabled": "wait", "pod-label-enabled": "wait", "namespace-labelled-during-outage": "wait",
		"plain": "start", "istio-system": "start", "platform-system": "start"}
	apiDown := map[string]string{"namespace-enabled": "wait", "pod-label-enabled": "wait", "namespace-labelled-during-outage": "wait",
		// A pod the snapshot lists as not captured waits too: the
		// snapshot predates any label put on it or its namespace since.
		"plain": "wait", "istio-system": "start", "platform-system": "start"}
	noFiles := map[string]string{"namespace-enabled": "wait", "pod-label-enabled": "wait", "namespace-labelled-during-outage": "wait",
		"plain": "wait", "istio-system": "start", "platform-system": "start"}
	allPass := map[string]string{"namespace-enabled": "start", "pod-label-enabled": "start", "namespace-labelled-during-outage": "start",
		"plain": "start", "istio-system": "start", "platform-system": "start"}
	now := time.Now()
	for _, st := range []struct {
		name  string
		setup func(t *testing.T, n node)
		extra string
		want  map[string]string
	}{
		{"agent restarting", func(t *testing.T, n node) { n.fallback(t, fakeAPIUp); n.snapshot(t, now) }, "", apiUp},
		{"agent crashlooping", func(t *testing.T, n node) { staleSocket(t, n.sock); n.fallback(t, fakeAPIUp); n.snapshot(t, now) }, "", apiUp},
		{"agent hung", func(t *testing.T, n node) { hungAgent(t, n.sock); n.fallback(t, fakeAPIUp); n.snapshot(t, now) }, `,"timeout":"300ms"`, apiUp},
		{"image unpullable after a reboot", func(t *testing.T, n node) {
			// tmpfs run dir empty; the state dir kept the credential's binary and the snapshot.
			_ = os.RemoveAll(n.run)
			n.fallback(t, fakeAPIUp)
			n.snapshot(t, now.Add(-72*time.Hour))
		}, "", apiUp},
		{"agent never served on the node", func(t *testing.T, n node) { n.fallback(t, fakeAPIUp) }, "", apiUp},
		{"DaemonSet left the node while down", func(t *testing.T, n node) { n.fallback(t, fakeAPIUpAgentGone); n.snapshot(t, now.Add(-time.Hour)) }, "", apiUp},
		// An older chart: the plugin's role cannot read the DaemonSet, so
		// the fallback cannot tell, and the wait reads as before.
		{"DaemonSet left the node while down, not readable", func(t *testing.T, n node) { n.fallback(t, fakeAPIUp); n.snapshot(t, now.Add(-time.Hour)) }, "", apiUp},
		{"uninstall killed mid-way", func(t *testing.T, n node) {
			n.fallback(t, fakeAPIUp)
			n.snapshot(t, now)
			if err := os.WriteFile(n.layout().Uninstalling(), nil, 0o600); err != nil {
				t.Fatal(err)
			}
		}, "", allPass},
		{"clock set back", func(t *testing.T, n node) { n.fallback(t, fakeAPIDown); n.snapshot(t, now.Add(240*time.Hour)) }, "", apiDown},
		{"API server down too", func(t *testing.T, n node) { n.fallback(t, fakeAPIDown); n.snapshot(t, now) }, "", apiDown},
		{"API server down, no snapshot", func(t *testing.T, n node) { n.fallback(t, fakeAPIDown) }, "", noFiles},
		{"nothing on the node (no credential, no snapshot)", func(t *testing.T, n node) {}, "", noFiles},
	} {
		t.Run(st.name, func(t *testing.T) {
			n := newNode(t)
			st.setup(t, n)
			for _, pod := range tablePods {
				out, err := run(t, add, n.conf(st.extra), pod.args())
				got := startOrWait(err == nil)
				if err != nil && cniCode(t, err) != types.ErrTryAgainLater {
					t.Errorf("%s: error %v, want code 11 or success", pod.name, err)
				}
				if err == nil && !jsonEqual(t, out, prevV1) {
					t.Errorf("%s: printed %q, want prevResult", pod.name, out)
				}
				if got != st.want[pod.name] {
					t.Errorf("%s: %s (%v), want %s", pod.name, got, err, st.want[pod.name])
				}
				// A wait says what ends it: the agent's return, or, when
				// its DaemonSet left the node, the operator's remedy.
				left := st.name == "DaemonSet left the node while down"
				if err != nil {
					msg := err.Error()
					if gone := strings.Contains(msg, agentGoneText); gone != left {
						t.Errorf("%s: %q names the DaemonSet leaving: %v, want %v", pod.name, msg, gone, left)
					}
					if left && (!strings.HasPrefix(msg, "ambient-cni: "+agentGoneText) || !strings.Contains(msg, "Put the node back in the DaemonSet's scope") ||
						!strings.Contains(msg, n.layout().Uninstalling()) || !strings.Contains(msg, "must be captured")) {
						t.Errorf("%s: %q, want the DaemonSet first, then the remedy", pod.name, msg)
					}
					if !left && !strings.Contains(msg, "check that the ambient-cni node agent is running") {
						t.Errorf("%s: %q, want the wait for the agent", pod.name, msg)
					}
				}
				if pod.mustCapture && got == "start" && st.name != "uninstall killed mid-way" {
					t.Errorf("SECURITY: %s started uncaptured", pod.name)
				}
				// CHECK agrees with ADD.
				_, cerr := run(t, check, n.conf(st.extra), pod.args())
				if (cerr == nil) != (err == nil) {
					t.Errorf("%s: CHECK %v disagrees with ADD %v", pod.name, cerr, err)
				}
			}
			// A pod let through is recorded for the agent to re-check
			// (the spool keeps one entry per sandbox; all are sb1 here).
			entries, _ := nodefiles.ListAdds(n.layout().AddSpool())
			want := 0
			for _, v := range st.want {
				if v == "start" {
					want = 1
				}
			}
			if len(entries) != want {
				t.Errorf("ADD spool holds %d entries, want %d", len(entries), want)
			}
		})
	}
}

// TestFailClosedOptIn: agentUnreachable fail-closed keeps its strict
// meaning: every pod outside the excluded namespaces waits, the control
// plane's too; the API server is not asked.
func TestFailClosedOptIn(t *testing.T) {
	n := newNode(t)
	n.fallback(t, "#!/bin/sh\necho asked >&2\nexit 1\n")
	for _, pod := range tablePods {
		if _, err := run(t, add, n.conf(`,"agentUnreachable":"fail-closed"`), pod.args()); err == nil || cniCode(t, err) != types.ErrTryAgainLater ||
			!strings.Contains(err.Error(), "fail-closed") {
			t.Errorf("%s: %v, want code 11 naming fail-closed", pod.name, err)
		}
	}
	out, err := run(t, add, conf(n.sock, "1.0.0", `,"excludedNamespaces":["shop"],"agentUnreachable":"fail-closed"`), k8sArgs)
	if err != nil || !jsonEqual(t, out, prevV1) {
		t.Errorf("excluded namespace with agent down: %q, %v", out, err)
	}
	if _, err := run(t, add, conf(n.sock, "1.0.0", `,"agentUnreachable":"open"`), k8sArgs); cniCode(t, err) != types.ErrInvalidNetworkConfig {
		t.Errorf("unknown agentUnreachable value: %v", err)
	}
}

// TestHostileFallback: a fallback binary that answers badly, hangs,
// floods, or is not ours never lets a pod that must be captured through;
// the plugin decides from the snapshot instead.
func TestHostileFallback(t *testing.T) {
	labelled := tablePods[1]
	for _, c := range []struct {
		name, script string
		mode         os.FileMode
	}{
		{"malformed", "#!/bin/sh\necho '{\"enroll\":'\n", 0o700},
		{"no enroll key", "#!/bin/sh\necho '{\"reason\":\"x\"}'\n", 0o700},
		{"unknown key", "#!/bin/sh\necho '{\"enroll\":false,\"pass\":true}'\n", 0o700},
		{"wrong type", "#!/bin/sh\necho '{\"enroll\":\"false\"}'\n", 0o700},
		{"oversized", "#!/bin/sh\nhead -c 100000 /dev/zero | tr '\\\\0' ' '; echo '{\"enroll\":false}'\n", 0o700},
		{"floods stderr and fails", "#!/bin/sh\nhead -c 1000000 /dev/zero >&2; exit 1\n", 0o700},
		{"hangs", "#!/bin/sh\nexec sleep 12\n", 0o700},
		{"group-writable", "#!/bin/sh\necho '{\"enroll\":false}'\n", 0o720},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.name == "hangs" && testing.Short() {
				t.Skip("waits for the fallback timeout")
			}
			n := newNode(t)
			n.snapshot(t, time.Now())
			p := n.layout().FallbackBinary()
			if err := os.WriteFile(p, []byte(c.script), c.mode); err != nil {
				t.Fatal(err)
			}
			_ = os.Chmod(p, c.mode)
			if _, err := run(t, add, n.conf(""), labelled.args()); err == nil || cniCode(t, err) != types.ErrTryAgainLater {
				t.Errorf("pod-label-enabled pod: %v, want code 11", err)
			}
			// The control plane still starts on the snapshot's word.
			if _, err := run(t, add, n.conf(""), tablePods[4].args()); err != nil {
				t.Errorf("istio-system pod: %v", err)
			}
		})
	}
	// A FIFO in place of the snapshot or the binary blocks nothing.
	n := newNode(t)
	for _, p := range []string{n.layout().StateSnapshot(), n.layout().FallbackBinary()} {
		if err := syscall.Mkfifo(p, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := run(t, add, n.conf(""), tablePods[3].args()); err == nil || cniCode(t, err) != types.ErrTryAgainLater {
		t.Errorf("FIFOs in the state dir: %v, want code 11", err)
	}
}

// The fallback binary gets the pod's identity as JSON on stdin.
func TestFallbackRequest(t *testing.T) {
	n := newNode(t)
	got := filepath.Join(t.TempDir(), "req")
	n.fallback(t, "#!/bin/sh\ncat > "+got+"\necho '{\"enroll\":false,\"reason\":\"r\"}'\n")
	if _, err := run(t, add, n.conf(""), tablePods[3].args()); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(got)
	var req map[string]any
	// checkAgent: the pod would wait if it had to be captured.
	if err := json.Unmarshal(b, &req); err != nil || req["namespace"] != "default" || req["name"] != "app" || req["uid"] != "uid-plain" || req["checkAgent"] != true {
		t.Errorf("request %q, %v", b, err)
	}
	entries, err := nodefiles.ListAdds(n.layout().AddSpool())
	if err != nil || len(entries) != 1 || entries[0].Event.Command != ambient.CommandAdd || entries[0].Event.PodUID != "uid-plain" {
		t.Errorf("ADD spool %+v, %v", entries, err)
	}
}

// TestHungAgentPlainPodStartsEarly: with the default timeout, a pod the
// API server shows outside the mesh does not wait out the timeout on a
// hung agent: the plugin asks the API server once the agent is slow.
func TestHungAgentPlainPodStartsEarly(t *testing.T) {
	n := newNode(t)
	hungAgent(t, n.sock)
	n.fallback(t, fakeAPIUp)
	var out, logs strings.Builder
	p := New(&out, &logs)
	err := p.Add(&CmdArgs{ContainerID: "sb1", Netns: "/var/run/netns/cni-1", IfName: "eth0", Args: tablePods[3].args(), StdinData: n.conf("")})
	t.Logf("plugin log:\n%s", logs.String())
	if err != nil || !strings.Contains(logs.String(), "has not answered in 5s") {
		t.Errorf("plain pod, hung agent: %v; want it started once the agent was slow", err)
	}
}

// addLogged runs ADD and returns the plugin's log with the error.
func addLogged(t *testing.T, stdin []byte, args string) (string, error) {
	t.Helper()
	var out, logs strings.Builder
	err := New(&out, &logs).Add(&CmdArgs{ContainerID: "sb1", Netns: "/var/run/netns/cni-1", IfName: "eth0", Args: args, StdinData: stdin})
	t.Logf("plugin log:\n%s", logs.String())
	return logs.String(), err
}

// TestHungAgentControlPlaneStartsEarly: with the API server down too, a
// hung agent does not hold the control plane for its whole timeout: a pod
// of a control-plane namespace the snapshot does not show enabled starts
// once the agent is slow, recorded for the agent to re-check. A pod of a
// control-plane namespace the snapshot shows enabled, a pod the snapshot
// cannot vouch for, and every pod under fail-closed still wait.
func TestHungAgentControlPlaneStartsEarly(t *testing.T) {
	const early = "has not answered in 1s and the API server cannot be asked"
	istiod, platform := tablePods[4], tablePods[5]
	fresh := tablePod{"new plain pod", "default", "new", "uid-new", false}
	for _, c := range []struct {
		name      string
		pod       tablePod
		snapshot  *nodefiles.EnablementSnapshot
		extra     string
		wantEarly bool
	}{
		{"istio-system", istiod, nil, "", true},
		{"platform namespace, no snapshot", platform, nil, "", true},
		{"istio-system enabled per the snapshot", istiod, &nodefiles.EnablementSnapshot{Generation: 1, EnabledNamespaces: []string{"istio-system"}}, "", false},
		{"istio-system pod captured per the snapshot", istiod, &nodefiles.EnablementSnapshot{Generation: 1, Pods: map[string]bool{istiod.uid: true}}, "", false},
		{"plain pod the snapshot does not list", fresh, nil, "", false},
		{"fail-closed", istiod, nil, `,"agentUnreachable":"fail-closed"`, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			n := newNode(t)
			hungAgent(t, n.sock)
			n.fallback(t, fakeAPIDown)
			if c.snapshot == nil {
				n.snapshot(t, time.Now())
			} else if err := nodefiles.WriteSnapshot(n.layout().StateSnapshot(), c.snapshot); err != nil {
				t.Fatal(err)
			}
			logs, err := addLogged(t, n.conf(`,"timeout":"2s"`+c.extra), c.pod.args())
			if got := strings.Contains(logs, early); got != c.wantEarly || c.wantEarly && err != nil {
				t.Errorf("%s/%s: %v, started once the agent was slow: %v; want %v", c.pod.ns, c.pod.pod, err, got, c.wantEarly)
			}
			if !c.wantEarly {
				return
			}
			entries, err := nodefiles.ListAdds(n.layout().AddSpool())
			if err != nil || len(entries) != 1 || entries[0].Event.PodUID != c.pod.uid {
				t.Errorf("ADD spool %+v, %v; want the pod recorded for the agent to re-check", entries, err)
			}
		})
	}
}

// FuzzParseVerdict: the only answer that lets a pod start is an object
// whose enroll is false.
func FuzzParseVerdict(f *testing.F) {
	fuzzseed.Add(f, "FuzzParseVerdict")
	f.Fuzz(func(t *testing.T, b []byte) {
		v, err := parseVerdict(b)
		if err != nil {
			return
		}
		var m map[string]any
		if json.Unmarshal(b, &m) == nil {
			if e, ok := m["enroll"].(bool); !ok || e != v.Enroll {
				t.Fatalf("parsed %q as enroll %v (without enroll: %v)", b, v.Enroll, !ok)
			}
		}
	})
}

// TestFallbackChildHoldsPipes: a fallback that leaves a child holding its
// output open cannot hold the plugin past its deadline.
func TestFallbackChildHoldsPipes(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for the fallback timeout")
	}
	n := newNode(t)
	n.snapshot(t, time.Now())
	n.fallback(t, "#!/bin/sh\nsleep 12 &\nsleep 12\n")
	if _, err := run(t, add, n.conf(""), tablePods[1].args()); err == nil || cniCode(t, err) != types.ErrTryAgainLater {
		t.Errorf("pod-label-enabled pod: %v, want code 11", err)
	}
}

// TestHungAgentFailClosedWaits: under agentUnreachable fail-closed a hung
// agent is a dead one for every pod: nothing starts once the agent is
// slow, and the API server is not asked, even for a plain pod it would
// show outside the mesh.
func TestHungAgentFailClosedWaits(t *testing.T) {
	n := newNode(t)
	hungAgent(t, n.sock)
	asked := filepath.Join(t.TempDir(), "asked")
	n.fallback(t, "#!/bin/sh\ntouch "+asked+"\necho '{\"enroll\":false,\"reason\":\"neither pod nor namespace labelled ambient\"}'\n")
	for _, pod := range []tablePod{tablePods[3], tablePods[4]} {
		logs, err := addLogged(t, n.conf(`,"timeout":"2s","agentUnreachable":"fail-closed"`), pod.args())
		if err == nil || cniCode(t, err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), "fail-closed") {
			t.Errorf("%s/%s, hung agent, fail-closed: %v; want code 11 naming fail-closed\n%s", pod.ns, pod.pod, err, logs)
		}
	}
	if _, err := os.Stat(asked); err == nil {
		t.Error("the API server was asked under fail-closed")
	}
}

// TestGivenBackToIstioCNI: a node given back to istio-cni while our
// agent is broken (crashed, its image not pullable) keeps our entry
// chained, with istio-cni's after it. While istio-cni's node agent
// answers on its plugin event socket (istioCNIRunDir, written by a
// takeover), every pod passes to istio-cni's plugin, nothing recorded for
// our agent; with nothing answering there (a socket file left by a gone
// istio-cni), or without istioCNIRunDir, pods are decided as before; under
// fail-closed they wait.
func TestGivenBackToIstioCNI(t *testing.T) {
	n := newNode(t)
	n.fallback(t, fakeAPIUp)
	staleSocket(t, n.sock)
	istioRun := filepath.Join(t.TempDir(), "istio-cni")
	if err := os.MkdirAll(istioRun, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(istioRun, ambient.IstioCNIEventSocket)
	confDir := t.TempDir()
	withIstio := n.conf(fmt.Sprintf(`,"istioCNIRunDir":%q,"istioCNIConfDir":%q`, istioRun, confDir))
	must := tablePods[0]
	// The network's chain as the runtime reads it: ours, then istio-cni's
	// once its installer has chained it.
	chain := filepath.Join(confDir, "10-k8s.conflist")
	writeChain := func(types ...string) {
		t.Helper()
		var ps []string
		for _, ty := range types {
			ps = append(ps, fmt.Sprintf(`{"type":%q}`, ty))
		}
		if err := os.WriteFile(chain, []byte(`{"cniVersion":"1.0.0","name":"k8s","plugins":[`+strings.Join(ps, ",")+`]}`), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	writeChain("bridge", "ambient-cni")

	// istio-cni gone: its socket file left, nothing answers.
	staleSocket(t, sock)
	if _, err := run(t, add, withIstio, must.args()); err == nil || cniCode(t, err) != types.ErrTryAgainLater {
		t.Fatalf("%s with istio-cni's socket stale: %v, want code 11", must.name, err)
	}
	_ = os.Remove(sock)

	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			_ = c.Close()
		}
	}()
	// istio-cni's agent answers before its installer chains its plugin:
	// a pod passed on now would start with no istio-cni after ours.
	if _, err := run(t, add, withIstio, must.args()); err == nil || cniCode(t, err) != types.ErrTryAgainLater {
		t.Fatalf("%s with istio-cni's agent answering and its plugin not chained: %v, want code 11", must.name, err)
	} else if !strings.Contains(err.Error(), "not in network k8s's chain") {
		t.Errorf("the wait does not say istio-cni's plugin is not chained: %v", err)
	}
	// Chained a moment ago: a runtime may still run the chain it loaded
	// before.
	writeChain("bridge", "ambient-cni", "istio-cni")
	if _, err := run(t, add, withIstio, must.args()); err == nil || cniCode(t, err) != types.ErrTryAgainLater {
		t.Fatalf("%s with istio-cni's plugin chained just now: %v, want code 11", must.name, err)
	}
	settled := time.Now().Add(-2 * istioCNIChainSettle)
	if err := os.Chtimes(chain, settled, settled); err != nil {
		t.Fatal(err)
	}
	for _, pod := range tablePods {
		logs, err := addLogged(t, withIstio, pod.args())
		if err != nil {
			t.Errorf("%s with istio-cni's agent answering: %v, want it passed to istio-cni's plugin", pod.name, err)
		} else if !strings.Contains(logs, "passing through to istio-cni") {
			t.Errorf("%s: the log does not say the pod went to istio-cni:\n%s", pod.name, logs)
		}
	}
	if ents, _ := os.ReadDir(n.layout().AddSpool()); len(ents) != 0 {
		t.Errorf("%d pods recorded for our agent to re-check; istio-cni's are not ours", len(ents))
	}
	// The same node without istioCNIRunDir, and under fail-closed.
	if _, err := run(t, add, n.conf(""), must.args()); err == nil || cniCode(t, err) != types.ErrTryAgainLater {
		t.Errorf("%s without istioCNIRunDir: %v, want code 11", must.name, err)
	}
	if _, err := run(t, add, n.conf(fmt.Sprintf(`,"istioCNIRunDir":%q,"agentUnreachable":"fail-closed"`, istioRun)), must.args()); err == nil || cniCode(t, err) != types.ErrTryAgainLater {
		t.Errorf("%s under fail-closed: %v, want code 11", must.name, err)
	}
	for _, bad := range []string{"relative/dir", "/a/../b", "/" + strings.Repeat("d", 100)} {
		if _, err := run(t, add, n.conf(fmt.Sprintf(`,"istioCNIRunDir":%q`, bad)), must.args()); cniCode(t, err) != types.ErrInvalidNetworkConfig {
			t.Errorf("istioCNIRunDir %q: %v, want an invalid config", bad, err)
		}
	}
	for _, bad := range []string{"relative/dir", "/a/../b", "/a/"} {
		if _, err := run(t, add, n.conf(fmt.Sprintf(`,"istioCNIRunDir":%q,"istioCNIConfDir":%q`, istioRun, bad)), must.args()); cniCode(t, err) != types.ErrInvalidNetworkConfig {
			t.Errorf("istioCNIConfDir %q: %v, want an invalid config", bad, err)
		}
	}
}
