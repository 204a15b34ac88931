package app

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

// TestStartupStepBoundShipped pins the shipped start-up bound and what it
// adds up to with the chart's liveness probe: a step may run a minute
// while what it waits on answers, and kubelet restarts an agent whose
// start-up is stuck about 3 minutes after the step began (the bound, then
// 12 failed probes 10 s apart), as docs/reliability.md says. An App built
// without a test bound uses it.
func TestStartupStepBoundShipped(t *testing.T) {
	if startupStepBound != time.Minute {
		t.Errorf("startupStepBound = %v; docs/reliability.md says 1 minute", startupStepBound)
	}
	b, err := os.ReadFile(filepath.Join("..", "..", "..", "deploy", "charts", "ambient-cni", "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var values struct {
		LivenessProbe struct {
			PeriodSeconds, FailureThreshold int
		} `json:"livenessProbe"`
	}
	if err := yaml.Unmarshal(b, &values); err != nil {
		t.Fatal(err)
	}
	p := values.LivenessProbe
	if restart := startupStepBound + time.Duration(p.PeriodSeconds*p.FailureThreshold)*time.Second; restart != 3*time.Minute {
		t.Errorf("a stuck start-up is restarted %v after its step began (bound %v, probe every %d s, %d failures); docs/reliability.md says 3 minutes",
			restart, startupStepBound, p.PeriodSeconds, p.FailureThreshold)
	}

	a := testApp(t)
	if got := a.startup.Bound(); got != startupStepBound {
		t.Errorf("an App without a test bound allows a start-up step %v; want the shipped %v", got, startupStepBound)
	}
}
