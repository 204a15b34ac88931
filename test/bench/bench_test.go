package bench

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

func repoRoot(t testing.TB) string {
	t.Helper()
	root, err := kubeenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return root
}

func parse(t testing.TB, env map[string]string) *installcni.Config {
	t.Helper()
	c, err := installcni.Parse(nil, func(k string) string { return env[k] }, io.Discard)
	if err != nil {
		t.Fatalf("install-cni refuses %v: %v", env, err)
	}
	return c
}

// TestBenchRunsShipped is issue 10's pin: the chart's default values,
// install-cni's own defaults and what `make bench` runs agree, so a tuned
// benchmark cannot hide a production bottleneck (test/integration pins the e2e
// harness the same way, TestHarnessRunsShippedDefaults).
func TestBenchRunsShipped(t *testing.T) {
	kubeenv.RequireTool(t, kubeenv.Helm)
	shipped, err := simnode.RenderChart(context.Background(), repoRoot(t))
	if err != nil {
		t.Fatal(err)
	}

	// The chart's default values configure install-cni exactly as its
	// own defaults do, but for what the container's view changes.
	chart := parse(t, shipped.Env)
	defaults, err := installcni.Parse([]string{"--node-name=node"}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	defaults.PodName, defaults.PodNamespace = "pod", simnode.ReleaseNamespace
	defaults.ProcRoot = chart.ProcRoot // the host's /proc, mounted at /host/proc
	// The host's name of the mounted CNI config directory, which
	// install-cni alone cannot know (test/deploy pins the chart's).
	defaults.CNIHostConfDir = chart.CNIHostConfDir
	// The plugin's ServiceAccount and the release signal are named for the
	// release (install-cni alone has no release, so no signal to watch;
	// test/deploy pins the chart's); the selector text is the chart's JSON
	// (its meaning compares as EnablementSelectors).
	defaults.PluginServiceAccount, defaults.EnablementSelectorText = chart.PluginServiceAccount, chart.EnablementSelectorText
	defaults.ReleaseSignal = chart.ReleaseSignal
	if !reflect.DeepEqual(chart, defaults) {
		t.Errorf("the chart's defaults differ from install-cni's:\n chart %+v\n  flag %+v", chart, defaults)
	}
	if chart.KubeClientQPS != defaults.KubeClientQPS || chart.KubeClientBurst != defaults.KubeClientBurst {
		t.Errorf("client limit: chart %v/%d, install-cni %v/%d", chart.KubeClientQPS, chart.KubeClientBurst, defaults.KubeClientQPS, defaults.KubeClientBurst)
	}
	if len(shipped.Args) != 0 {
		t.Errorf("the DaemonSet passes args %q; the benchmark passes them on, check they are what it should run", shipped.Args)
	}

	// The benchmark changes only where things are and who the agent is.
	wantLocal := []string{"AMBIENT_AGENT_SOCKET", "AMBIENT_CNI_BIN_DIR", "AMBIENT_CNI_CONF_DIR", "AMBIENT_KUBECONFIG",
		"AMBIENT_NODE_NAME", "AMBIENT_PLUGIN_BINARY", "AMBIENT_POD_NAME", "AMBIENT_PROC_ROOT", "AMBIENT_STATE_DIR", "AMBIENT_ZDS_SOCKET"}
	var local []string
	for k := range simnode.NodeLocal {
		local = append(local, k)
	}
	slices.Sort(local)
	if !slices.Equal(local, wantLocal) {
		t.Errorf("NodeLocal is %v, want %v: a setting the benchmark changes must say where things are, never tune", local, wantLocal)
	}
	for _, b := range Backends() {
		env, err := simnode.AgentEnv(shipped, simnode.Paths{
			Name: "bench-node", PodName: "bench-pod", CNIBinDir: "/b/bin", CNIConfDir: "/b/net.d", PluginBinary: "/b/ambient-cni",
			AgentSocket: "/b/run/agent.sock", ZDSSocket: "/b/run/zt.sock", StateDir: "/b/state", Kubeconfig: "/b/kubeconfig",
		}, b.settings())
		if err != nil {
			t.Fatal(err)
		}
		for k, v := range env {
			if shipped.Env[k] == v {
				continue
			}
			if _, ok := simnode.NodeLocal[k]; ok || (b.Selector != "" && k == installcni.EnvName(b.Selector)) {
				continue
			}
			t.Errorf("%s: the benchmark sets %s=%q, the chart %q", b.Name, k, v, shipped.Env[k])
		}
		for k := range shipped.Env {
			if _, ok := env[k]; !ok {
				t.Errorf("%s: the benchmark drops the chart's %s", b.Name, k)
			}
		}
		got := parse(t, env)
		want := *chart
		want.NodeName, want.PodName, want.CNIBinDir, want.CNIConfDir = got.NodeName, got.PodName, got.CNIBinDir, got.CNIConfDir
		want.PluginBinary, want.AgentSocket, want.ZDSSocket, want.ProcRoot, want.Kubeconfig = got.PluginBinary, got.AgentSocket, got.ZDSSocket, got.ProcRoot, got.Kubeconfig
		want.StateDir = got.StateDir
		if b.Selector == "" {
			if !reflect.DeepEqual(*got, want) {
				t.Errorf("%s: the benchmark's configuration differs from the chart's beyond node-local settings:\n got %+v\nwant %+v", b.Name, got, want)
			}
		}
		if got.KubeClientQPS != defaults.KubeClientQPS || got.KubeClientBurst != defaults.KubeClientBurst {
			t.Errorf("%s: the benchmark's agent runs at %v/%d requests/s, shipped %v/%d", b.Name, got.KubeClientQPS, got.KubeClientBurst, defaults.KubeClientQPS, defaults.KubeClientBurst)
		}
		// Nothing of the caller's environment reaches the agent but PATH.
		for _, kv := range simnode.Environ(env) {
			k, _, _ := strings.Cut(kv, "=")
			if _, ok := env[k]; !ok && k != "PATH" {
				t.Errorf("%s: the agent's environment carries %s", b.Name, kv)
			}
		}
	}
}

// The audit log follower counts only the agent's completed non-watch
// requests, survives a line written in two parts, and skips junk.
func TestAuditLog(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.log")
	a := newAuditLog(path, "n1")
	if n, err := a.mark(); err != nil || n != 0 {
		t.Fatalf("missing log: %d, %v", n, err)
	}
	ev := func(stage, verb, ua, res, sub string, code int) string {
		b, _ := json.Marshal(map[string]any{"stage": stage, "verb": verb, "userAgent": ua,
			"objectRef": map[string]any{"resource": res, "subresource": sub}, "responseStatus": map[string]any{"code": code},
			"requestReceivedTimestamp": "2026-01-01T00:00:00.000000Z", "stageTimestamp": "2026-01-01T00:00:00.004000Z"})
		return string(b) + "\n"
	}
	lines := ev("ResponseComplete", "patch", "ambient-cni/n1", "pods", "status", 200) +
		ev("ResponseComplete", "watch", "ambient-cni/n1", "pods", "", 200) +
		ev("ResponseComplete", "get", "ambient-cni/n1-2", "pods", "", 200) +
		ev("ResponseStarted", "get", "ambient-cni/n1", "pods", "", 200) +
		"not json\n" +
		ev("ResponseComplete", "patch", "ambient-cni/n1", "pods", "status", 409)
	half := len(lines) - 20
	if err := os.WriteFile(path, []byte(lines[:half]), 0o600); err != nil {
		t.Fatal(err)
	}
	if n, _ := a.mark(); n != 1 {
		t.Fatalf("after a partial write: %d requests, want 1", n)
	}
	f, _ := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	_, _ = f.WriteString(lines[half:])
	_ = f.Close()
	if n, _ := a.mark(); n != 2 {
		t.Fatalf("%d requests, want 2", n)
	}
	got := summarize(a.since(0))
	if want := map[string]int{"patch pods/status": 1, "patch pods/status (409)": 1}; !reflect.DeepEqual(got, want) {
		t.Errorf("summary %v, want %v", got, want)
	}
	if m := meanServerMs(a.since(0)); m != 4 {
		t.Errorf("mean server time %v ms, want 4", m)
	}
	if a.watches != 1 || a.bad != 1 {
		t.Errorf("watches %d, bad lines %d", a.watches, a.bad)
	}
}

// buildBench skips (fails under CI=true) without what the benchmark needs,
// builds the shipped binaries as make build does into bin and the
// benchmark command into benchBin, both under the test's tmp.
func buildBench(t *testing.T) (root, tmp, bin, benchBin string) {
	t.Helper()
	if os.Getenv("AMBIENT_UNIT_ONLY") != "" {
		t.Skip("skipping: runs the benchmark, and AMBIENT_UNIT_ONLY is set")
	}
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "make", "go", "iptables-save", "iptables-restore", "ip6tables-restore", "nsenter")
	for _, tool := range []string{kubeenv.Etcd, kubeenv.KubeAPIServer, kubeenv.Helm} {
		kubeenv.RequireTool(t, tool)
	}
	root = repoRoot(t)
	tmp = t.TempDir()
	bin = filepath.Join(tmp, "bin")
	if out, err := exec.Command("make", "-C", root, "--no-print-directory", "build", "BIN="+bin).CombinedOutput(); err != nil {
		t.Fatalf("make build: %v\n%s", err, out)
	}
	benchBin = filepath.Join(tmp, "bench")
	build := exec.Command("go", "build", "-o", benchBin, "./test/bench/cmd/bench")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build the benchmark: %v\n%s", err, out)
	}
	return root, tmp, bin, benchBin
}

// TestQuickBench runs the harness end to end (BENCH_QUICK: few samples)
// on binaries built as make build builds them: every figure is produced
// and nothing is left behind. Figures are not asserted: this machine is
// shared and busy.
func TestQuickBench(t *testing.T) {
	// Side by side with the other quick runs: each has its own API server,
	// work dir and binaries, none asserts a figure, and in series they are
	// make test's longest package.
	t.Parallel()
	root, tmp, bin, benchBin := buildBench(t)
	out := filepath.Join(tmp, "out")
	cmd := exec.Command(benchBin, "-quick", "-out", out,
		"-install-cni", filepath.Join(bin, "install-cni"), "-plugin", filepath.Join(bin, "ambient-cni"))
	cmd.Dir = root
	var stderr strings.Builder
	cmd.Stderr = &stderr
	table, err := cmd.Output()
	t.Logf("progress:\n%s", stderr.String())
	t.Logf("table:\n%s", table)
	if err != nil {
		t.Fatalf("bench: %v", err)
	}
	b, err := os.ReadFile(filepath.Join(out, "latest.json"))
	if err != nil {
		t.Fatal(err)
	}
	var res Result
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatal(err)
	}
	if !res.Quick || res.Plugin.SizeBytes == 0 || res.Plugin.ExecP50Ms <= 0 || len(res.Backends) != 2 {
		t.Fatalf("result %+v", res)
	}
	if _, err := os.Stat(res.WorkDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("work dir %s left behind (%v)", res.WorkDir, err)
	}
	ran := 0
	for _, br := range res.Backends {
		if br.Unavailable != "" {
			if !strings.Contains(string(table), br.Name+": n/a") {
				t.Errorf("%s is unavailable but the table does not say so", br.Name)
			}
			continue
		}
		ran++
		if br.Error != "" {
			t.Errorf("%s: %s", br.Name, br.Error)
		}
		if len(br.Latency) != 8 || len(br.Enroll) != 2 || br.RSSIdleMB <= 0 || br.RSSPodsMB <= 0 || br.Detected == "" {
			t.Errorf("%s: incomplete figures %+v", br.Name, br)
		}
		// Both verifier counts (the second after deleting pods, as the
		// full run does) and the drift found and repaired.
		if len(br.Verifier) != 2 || br.VerifierDrift == nil || br.VerifierDrift.RepairSeconds <= 0 {
			t.Errorf("%s: verifier figures %+v, drift %+v", br.Name, br.Verifier, br.VerifierDrift)
		}
		for _, l := range br.Latency {
			if l.Samples == 0 || l.Errors != 0 || l.P50Ms <= 0 || l.ChainP50Ms <= 0 {
				t.Errorf("%s: %s %s x%d: %+v", br.Name, l.Kind, l.Op, l.Concurrency, l)
			}
			// CPU comes from /proc in clock ticks (10 ms): a quick run of a few
			// pods costing a few ms each can honestly read 0, so only a
			// negative figure is a harness bug.
			if l.CPUMsPerPod < 0 || l.OwnCPUMsPerPod < 0 {
				t.Errorf("%s: negative CPU figure %+v", br.Name, l)
			}
			if l.Kind == "ambient" && l.Op == "ADD" && l.APIPerPod <= 0 {
				t.Errorf("%s: ambient ADD made no API request? %+v", br.Name, l)
			}
			// A refused request is a harness gap (an object a real node has)
			// or a bug, never part of a figure.
			for req := range l.APIRequests {
				if strings.Contains(req, "(4") || strings.Contains(req, "(5") {
					t.Errorf("%s: %s %s x%d: failed API request %q", br.Name, l.Kind, l.Op, l.Concurrency, req)
				}
			}
		}
		for _, e := range br.Enroll {
			if e.Seconds <= 0 || e.APIPerPod <= 0 {
				t.Errorf("%s: enroll %+v", br.Name, e)
			}
		}
		if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(br.AgentPID), "exe")); err == nil {
			if exe, _ := os.Readlink(filepath.Join("/proc", strconv.Itoa(br.AgentPID), "exe")); strings.Contains(exe, "install-cni") {
				t.Errorf("%s: install-cni (pid %d) still runs", br.Name, br.AgentPID)
			}
		}
	}
	if ran == 0 {
		t.Fatal("no backend ran")
	}
	// Istio's column: skipped only when its binaries are absent outside
	// CI; its failure does not fail the bench command, but it fails the
	// harness's smoke test.
	if len(res.Peers) != len(Options{Quick: true}.peers()) {
		t.Fatalf("peers %+v", res.Peers)
	}
	for _, p := range res.Peers {
		switch {
		case p.Unavailable != "":
			if os.Getenv("CI") == "true" {
				t.Errorf("%s: n/a under CI: %s", p.Name, p.Unavailable)
			} else {
				t.Logf("%s: n/a: %s", p.Name, p.Unavailable)
			}
			if !strings.Contains(string(table), p.Name+": n/a") {
				t.Errorf("%s is unavailable but the table does not say so", p.Name)
			}
		case p.Error != "":
			t.Errorf("%s: %s", p.Name, p.Error)
		default:
			if len(p.Latency) != 8 || p.RSSIdleMB <= 0 || p.Plugin == nil || p.Plugin.ExecP50Ms <= 0 ||
				len(p.Enroll) != 2 || p.RSSPodsMB <= 0 || p.RSSPods == 0 {
				t.Errorf("%s: incomplete figures %+v", p.Name, p)
			}
			// Its enrollment of running pods, found by its /host/proc scan.
			for _, e := range p.Enroll {
				if e.Seconds <= 0 || e.CapturedSeconds <= 0 || e.APIPerPod <= 0 || e.CPUMsPerPod < 0 || e.OwnCPUMsPerPod < 0 {
					t.Errorf("%s: enroll %+v", p.Name, e)
				}
			}
			for _, l := range p.Latency {
				if l.Samples == 0 || l.Errors != 0 || l.P50Ms <= 0 || l.ChainP50Ms <= 0 {
					t.Errorf("%s: %s %s x%d: %+v", p.Name, l.Kind, l.Op, l.Concurrency, l)
				}
			}
		}
	}
}

// Children are timed from fork to exit by the program they exec'd;
// threads (forked, never exec'd) and half-seen processes are skipped.
func TestChildTimes(t *testing.T) {
	script := `install-cni  100  10.000000: sched:sched_process_fork: comm=install-cni pid=100 child_comm=install-cni child_pid=200
install-cni  100  10.000100: sched:sched_process_fork: comm=install-cni pid=100 child_comm=install-cni child_pid=201
iptables-nft-re  200  10.001000: sched:sched_process_exec: filename=/usr/sbin/iptables-nft-restore pid=200 old_pid=200
iptables-nft-re  200  10.004000: sched:sched_process_exit: comm=iptables-nft-re pid=200 prio=120 group_dead=true
install-cni  201  10.005000: sched:sched_process_exit: comm=install-cni pid=201 prio=120 group_dead=false
ipset  300  10.006000: sched:sched_process_exec: filename=/usr/sbin/ipset pid=300 old_pid=300
ipset  300  10.007000: sched:sched_process_exit: comm=ipset pid=300 prio=120 group_dead=true
garbage line
`
	got := childTimes([]byte(script))
	c, ok := got["iptables-nft-restore"]
	if len(got) != 1 || !ok || c.Count != 1 || c.TotalMs < 3.99 || c.TotalMs > 4.01 {
		t.Errorf("child times %+v", got)
	}
}
