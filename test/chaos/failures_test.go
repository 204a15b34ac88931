package chaos

import (
	"strings"
	"testing"
)

// TestFailureLines: the summary printed last keeps a failed group's test
// messages and FAIL lines, not the agent log dumped under them.
func TestFailureLines(t *testing.T) {
	out := strings.Join([]string{
		"=== RUN   TestSoak",
		"    soak_test.go:101: after 100 warm-up cycles (12s): agent 18 fds",
		"    node_test.go:361: the agent stayed busy for 1m0s",
		"    node_test.go:127: install-cni warnings and errors (log x):",
		"        time=2026-12-02T17:04:30.755Z level=WARN msg=\"renew\" retry=10s",
		"--- FAIL: TestSoak (418.10s)",
		"FAIL",
	}, "\n")
	got := failureLines("soak", []byte(out))
	want := []string{
		"  [soak] soak_test.go:101: after 100 warm-up cycles (12s): agent 18 fds",
		"  [soak] node_test.go:361: the agent stayed busy for 1m0s",
		"  [soak] node_test.go:127: install-cni warnings and errors (log x):",
		"  [soak] --- FAIL: TestSoak (418.10s)",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("failureLines:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
