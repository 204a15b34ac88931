package bench

import (
	"strings"
	"testing"
)

// The table has one row per figure and one column per backend; a backend
// that cannot run is n/a in every row, a failed one says so.
func TestWriteTable(t *testing.T) {
	r := &Result{Commit: "abc", Plugin: Plugin{SizeBytes: 3 << 20, ExecP50Ms: 2.5}, Starts: StartCost{Starts: 12, StartSeconds: 96.4, StopSeconds: 30}}
	ok := BackendResult{Name: "iptables", Detected: "nft", RSSIdleMB: 30, RSSPodsMB: 45, RSSPods: 500,
		Enroll: []Enroll{{Pods: 100, Seconds: 1, MsPerPod: 10}, {Pods: 500, Seconds: 5, MsPerPod: 10, CPUMsPerPod: 2.5, OwnCPUMsPerPod: 1.25}}}
	for _, kind := range []string{"ambient", "non-ambient"} {
		for _, op := range []string{"ADD", "DEL"} {
			for _, c := range []int{1, 8} {
				ok.Latency = append(ok.Latency, Latency{Kind: kind, Op: op, Concurrency: c, DeltaP50Ms: 4, DeltaP99Ms: 9, APIPerPod: 1})
			}
		}
	}
	r.Backends = []BackendResult{ok, {Name: "nftables", Unavailable: "no setting"}, {Name: "other", Error: "boom"}}
	out := r.String()
	lines := strings.Split(strings.TrimSpace(out), "\n")
	var table []string
	for _, l := range lines {
		if strings.HasPrefix(l, "|") {
			table = append(table, l)
		}
	}
	if len(table) < 20 {
		t.Fatalf("table has %d rows:\n%s", len(table), out)
	}
	width := len([]rune(table[0]))
	for _, l := range table {
		if strings.Count(l, "|") != 6 || len([]rune(l)) != width {
			t.Errorf("ragged row %q", l)
		}
	}
	for _, want := range []string{"iptables (nft)", "| +4.0 / +9.0", "enroll 500 running pods", "30.0 / 45.0 (500 pods)",
		"agent CPU per enrolled pod, 500 running pods (own + children; own alone): ms", "| 2.50 (1.25)", "3.00 MiB / 2.50 ms",
		"nftables: n/a: no setting", "other: FAILED: boom", "| failed", "interleaving: 12 system starts took 96 s to ready and settled, the stops between reps 30 s"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if strings.Count(out, "| n/a") < 19 {
		t.Errorf("the unavailable backend is not n/a in every row:\n%s", out)
	}
}

// Every rep starts with the next system: over as many reps as systems,
// each is first once and runs once per rep.
func TestRepOrder(t *testing.T) {
	first := map[int]int{}
	for rep := range 4 {
		o := repOrder(4, rep)
		first[o[0]]++
		seen := map[int]bool{}
		for _, i := range o {
			seen[i] = true
		}
		if len(o) != 4 || len(seen) != 4 {
			t.Errorf("rep %d: order %v", rep, o)
		}
	}
	if len(first) != 4 {
		t.Errorf("first systems over 4 reps: %v", first)
	}
}

// A peer's ratio divides its numbers by ours pair by pair, and has none
// where ours is not positive or the shapes differ.
func TestRatioCell(t *testing.T) {
	for _, c := range []struct{ peer, ours, want string }{
		{"+72.6 / +213.7", "+12.9 / +16.4", "5.6× / 13.0×"},
		{"+5.0 / +1.0", "-1.0 / +2.0", "- / 0.5×"},
		{"104.7 / -", "31.8 / 39.7 (500 pods)", "-"},
		{"118.27 MiB / 55.19 ms", "3.11 MiB / 1.58 ms", "38.0× / 34.9×"},
		{"n/a", "+1.0 / +1.0", "-"},
	} {
		if got := ratioCell(c.peer, c.ours); got != c.want {
			t.Errorf("ratioCell(%q, %q) = %q, want %q", c.peer, c.ours, got, c.want)
		}
	}
}

// The quiet check reads the aggregate cpu line: idle and iowait are idle,
// guest time is already in user.
func TestParseStatCPU(t *testing.T) {
	total, idle, err := parseStatCPU("cpu  100 0 50 800 50 0 0 0 30 0\ncpu0 1 2 3 4 5\n")
	if err != nil || total != 1000 || idle != 850 {
		t.Errorf("parseStatCPU = %d, %d, %v", total, idle, err)
	}
	for _, bad := range []string{"", "cpu0 1 2 3 4 5", "cpu 1 2 x 4 5"} {
		if _, _, err := parseStatCPU(bad); err == nil {
			t.Errorf("parseStatCPU(%q): want an error", bad)
		}
	}
}

// A peer's enrollment fills its column with ratios to ours; a peer whose
// enrollment failed keeps its other figures and says failed in the
// enrollment rows.
func TestWriteTablePeerEnroll(t *testing.T) {
	enroll := func(cpu float64) []Enroll {
		return []Enroll{{Pods: 100, Seconds: 1, MsPerPod: 10, CapturedSeconds: 1}, {Pods: 500, Seconds: 5, MsPerPod: 10, CapturedSeconds: 2, CPUMsPerPod: cpu, OwnCPUMsPerPod: cpu / 2}}
	}
	r := &Result{Commit: "abc",
		Backends: []BackendResult{{Name: "nftables", RSSIdleMB: 20, RSSPodsMB: 30, RSSPods: 500, Enroll: enroll(1), KubeClientQPS: 50, KubeClientBurst: 100}},
		Peers: []BackendResult{
			{Name: "istio-cni", RSSIdleMB: 40, RSSPodsMB: 90, RSSPods: 500, Enroll: enroll(4), KubeClientQPS: 80, KubeClientBurst: 160},
			{Name: "istio-cni-nftables", RSSIdleMB: 40, Error: "enroll 500 running pods: boom"},
		}}
	out := r.String()
	var cpu string
	for l := range strings.SplitSeq(out, "\n") {
		if strings.Contains(l, "agent CPU per enrolled pod") {
			cpu = l
		}
	}
	for _, want := range []string{"| 1.00 (0.50)", "| 4.00 (2.00)", "| failed", "| 4.0×"} {
		if !strings.Contains(cpu, want) {
			t.Errorf("CPU per enrolled pod row %q lacks %q", cpu, want)
		}
	}
	for _, want := range []string{"40.0 / 90.0 (500 pods)", "| 40.0 / -", "istio-cni: API requests count install-cni's and its plugin's (one ServiceAccount); client limit 80/s burst 160 (its own); enroll 100",
		"istio-cni-nftables: FAILED: enroll 500 running pods: boom"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}
