package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// TestQuickScale runs the scale harness end to end with a small load
// (bench -scale -quick: 200 namespaces, 400 pods) on binaries built as
// make build builds them: the agent catches up, every figure is produced
// and printed beside its target, and nothing is left behind. Figures are
// not asserted: this machine is shared and busy, and a small load says
// nothing about scale.
func TestQuickScale(t *testing.T) {
	t.Parallel() // as TestQuickBench
	var res ScaleResult
	report := runQuick(t, "scale", &res, "-scale", "-quick")
	if !res.Quick || res.Namespaces != 200 || res.Pods != 400 || res.AnnotationBytes != 10<<10 {
		t.Errorf("not the quick load: %+v", res)
	}
	if res.Idle.RSSMiB <= 0 || res.After.RSSMiB <= 0 || res.PeakRSSMiB < res.After.RSSMiB || res.LoadSeconds <= 0 {
		t.Errorf("incomplete figures %+v", res)
	}
	if res.Restarted.RSSMiB <= 0 || res.RestartPeakRSSMiB < res.Restarted.RSSMiB {
		t.Errorf("no figures of the restarted agent: %+v", res)
	}
	// Only the agent's own client limit is the chart's; the loader's is
	// its own.
	if res.KubeClientQPS <= 0 || res.KubeClientQPS >= 5000 {
		t.Errorf("the agent ran at %v requests/s", res.KubeClientQPS)
	}
	for _, want := range []string{"agent RSS idle", "agent RSS after the load", "RSS growth per namespace", "≤ 40", "≤ 1"} {
		if !strings.Contains(string(report), want) {
			t.Errorf("the report lacks %q", want)
		}
	}
	if n := strings.Count(string(report), "| met") + strings.Count(string(report), "| missed"); n != 2 {
		t.Errorf("the report has %d met/missed words, want 2 (RSS after, growth per namespace)", n)
	}
	if _, err := os.Stat(res.WorkDir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("work dir %s left behind (%v)", res.WorkDir, err)
	}
	// The agent was stopped with the node (a gone process, or a new one
	// that reused its number).
	poll.Within(t, time.Minute, fmt.Sprintf("install-cni (pid %d) to stop", res.AgentPID), func() bool {
		exe, err := os.Readlink(filepath.Join("/proc", strconv.Itoa(res.AgentPID), "exe"))
		return err != nil || !strings.Contains(exe, "install-cni")
	})
}

// TestQuickAgents runs the fleet harness end to end with 5 agents (bench
// -agents 5 -quick) on binaries built as make build builds them: every
// agent is ready and holds its watches, every system's figures are
// produced and printed, and nothing is left behind (the run fails on a
// mount left under its directory). istio-cni's column runs when it is
// built. Figures are not asserted.
func TestQuickAgents(t *testing.T) {
	t.Parallel() // as TestQuickBench
	var res FleetResult
	report := runQuick(t, "agents", &res, "-agents", "5", "-quick")
	if !res.Quick || res.Agents != 5 || len(res.Systems) == 0 {
		t.Fatalf("not the quick fleet: %+v", res)
	}
	for _, s := range res.Systems {
		if s.Error != "" || len(s.WatchesPerAgent) == 0 || s.Start.WatchStarts < res.Agents || s.Rest.RSSMiB <= 0 {
			t.Errorf("%s: incomplete figures %+v", s.Name, s)
		}
	}
	for _, want := range []string{"watches held open", "rest: requests per minute", "requests per agent"} {
		if !strings.Contains(string(report), want) {
			t.Errorf("the report lacks %q", want)
		}
	}
}

// runQuick runs the bench command with args on the binaries make build
// builds, logs its progress and report, decodes its KIND-latest.json into
// res and returns the report.
func runQuick(t *testing.T, kind string, res any, args ...string) []byte {
	t.Helper()
	root, tmp, bin, benchBin := buildBench(t)
	out := filepath.Join(tmp, "out")
	cmd := exec.Command(benchBin, append(args, "-out", out,
		"-install-cni", filepath.Join(bin, "install-cni"), "-plugin", filepath.Join(bin, "ambient-cni"))...)
	cmd.Dir = root
	var stderr strings.Builder
	cmd.Stderr = &stderr
	report, err := cmd.Output()
	t.Logf("progress:\n%s", stderr.String())
	t.Logf("report:\n%s", report)
	if err != nil {
		t.Fatalf("bench %s: %v", args[0], err)
	}
	b, err := os.ReadFile(filepath.Join(out, kind+"-latest.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, res); err != nil {
		t.Fatal(err)
	}
	return report
}
