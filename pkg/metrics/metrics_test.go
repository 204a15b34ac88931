package metrics

import (
	"context"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// value gathers the registry and returns the value of the series name with
// the given label pairs (name, value, ...), and whether it exists.
func value(t *testing.T, m *Metrics, name string, labels ...string) (float64, bool) {
	t.Helper()
	fams, err := m.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, s := range f.GetMetric() {
			got := map[string]string{}
			for _, l := range s.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if got[labels[i]] != labels[i+1] {
					continue series
				}
			}
			return number(s), true
		}
	}
	return 0, false
}

func number(s *dto.Metric) float64 {
	switch {
	case s.Counter != nil:
		return s.Counter.GetValue()
	case s.Gauge != nil:
		return s.Gauge.GetValue()
	}
	return 0
}

// istio-cni's names are served beside ours, with istio-cni's labels, and
// follow the same events.
func TestIstioNamesBesideOurs(t *testing.T) {
	m := New()
	m.ObserveRequest("ADD", "enrolled", 200, time.Millisecond)
	m.ObserveRequest("ADD", "retry", 503, time.Millisecond)
	// Istio's plugin never forwards the ADD of a pod outside the mesh.
	m.ObserveRequest("ADD", "not-enrolled", 200, time.Millisecond)
	m.ObserveRequest("DEL", "removed", 200, time.Millisecond)
	for code, want := range map[string]float64{"200": 1, "503": 1} {
		if got, _ := value(t, m, "istio_cni_plugin_requests_total", "response_code", code); got != want {
			t.Errorf(`istio_cni_plugin_requests_total{response_code=%q} = %v, want %v (ADDs of pods in the mesh only)`, code, got, want)
		}
	}
	if got, _ := value(t, m, "ambient_cni_cni_requests_total", "verb", "ADD", "result", "not-enrolled"); got != 1 {
		t.Errorf("ambient_cni_cni_requests_total ADD not-enrolled = %v, want 1", got)
	}

	// istio_cni_installs_total{result} with Istio's result values, each
	// served from the start.
	for _, r := range []string{"SUCCESS", "COPY_BINARIES_FAILURE", "CREATE_CNI_CONFIG_FAILURE"} {
		if got, ok := value(t, m, "istio_cni_installs_total", "result", r); !ok || got != 0 {
			t.Errorf("istio_cni_installs_total{result=%q} = %v (served %v), want 0 before any install", r, got, ok)
		}
	}
	m.ObserveInstall(InstallSuccess)
	m.ObserveInstall(InstallSuccess)
	m.ObserveInstall(InstallConfigFailure)
	for r, want := range map[string]float64{"SUCCESS": 2, "CREATE_CNI_CONFIG_FAILURE": 1, "COPY_BINARIES_FAILURE": 0} {
		if got, _ := value(t, m, "istio_cni_installs_total", "result", r); got != want {
			t.Errorf("istio_cni_installs_total{result=%q} = %v, want %v", r, got, want)
		}
	}
	// nodeagent_reconcile_events_total{type}, Istio's add/update/delete.
	m.ObserveEvent("add")
	m.ObserveEvent("update")
	m.ObserveEvent("update")
	for ty, want := range map[string]float64{"add": 1, "update": 2, "delete": 0} {
		if got, ok := value(t, m, "nodeagent_reconcile_events_total", "type", ty); !ok || got != want {
			t.Errorf("nodeagent_reconcile_events_total{type=%q} = %v (served %v), want %v", ty, got, ok, want)
		}
	}
	if got, _ := value(t, m, "ambient_cni_cni_requests_total", "verb", "DEL", "result", "removed"); got != 1 {
		t.Errorf("ambient_cni_cni_requests_total DEL removed = %v, want 1", got)
	}

	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	wg.Go(func() {
		_ = m.RunGauges(ctx, func() map[string]int { return nil }, func() int { return 2 }, func() bool { return true }, nil)
	})
	defer wg.Wait()
	defer cancel()
	deadline := time.Now().Add(time.Minute)
	for {
		ready, _ := value(t, m, "istio_cni_install_ready")
		zt, _ := value(t, m, "ztunnel_connected")
		ours, _ := value(t, m, "ambient_cni_ztunnel_connections")
		if ready == 1 && zt == 2 && ours == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("gauges never followed the installer and ZDS: install_ready=%v ztunnel_connected=%v ours=%v", ready, zt, ours)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// The build metric is served from the start with the binary's version
// and commit ("dev" and "unknown" in an unstamped test binary).
func TestBuildInfo(t *testing.T) {
	m := New()
	if got, ok := value(t, m, "ambient_cni_build_info", "version", "dev", "commit", "unknown"); !ok || got != 1 {
		t.Fatalf(`ambient_cni_build_info{version="dev",commit="unknown"} = %v (present %v), want 1`, got, ok)
	}
}

// The plugin credential's series exist from the start (0: none yet, so
// an alert sees a node without one), then carry its issue and expiry
// times; failures count.
func TestPluginCredential(t *testing.T) {
	m := New()
	for _, name := range []string{"ambient_cni_plugin_credential_issued_timestamp_seconds", "ambient_cni_plugin_credential_expiry_timestamp_seconds", "ambient_cni_plugin_credential_renewal_failures_total"} {
		if v, ok := value(t, m, name); !ok || v != 0 {
			t.Errorf("%s = %v (served %v), want 0 before any credential", name, v, ok)
		}
	}
	issued := time.Unix(1_700_000_000, 0)
	m.ObservePluginCredential(issued, issued.Add(365*24*time.Hour))
	m.PluginCredentialFailures.Inc()
	if v, _ := value(t, m, "ambient_cni_plugin_credential_issued_timestamp_seconds"); v != 1_700_000_000 {
		t.Errorf("issued = %v", v)
	}
	if v, _ := value(t, m, "ambient_cni_plugin_credential_expiry_timestamp_seconds"); v != 1_700_000_000+365*24*3600 {
		t.Errorf("expiry = %v", v)
	}
	if v, _ := value(t, m, "ambient_cni_plugin_credential_renewal_failures_total"); v != 1 {
		t.Errorf("failures = %v", v)
	}
}
