package health

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/metrics"
)

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestEndpoints(t *testing.T) {
	m := metrics.New()
	s := New(slog.New(slog.DiscardHandler), m.Registry, func() any { return map[string]string{"uid-1": "enabled"} })
	var configOK atomic.Bool
	configOK.Store(true)
	s.AddCheck("config", func() error {
		if !configOK.Load() {
			return errors.New("conflist lacks our entry")
		}
		return nil
	})
	ctx, cancel := context.WithCancel(context.Background())
	addrCh := make(chan net.Addr, 1)
	errCh := make(chan error, 1)
	go func() { errCh <- s.Serve(ctx, "127.0.0.1:0", func(a net.Addr) { addrCh <- a }) }()
	base := "http://" + (<-addrCh).String()

	if code, _ := get(t, base+"/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}
	if code, _ := get(t, base+"/readyz"); code != 200 {
		t.Errorf("/readyz = %d while ready", code)
	}
	configOK.Store(false)
	code, body := get(t, base+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "config: conflist lacks our entry") {
		t.Errorf("/readyz = %d %q while config is missing", code, body)
	}
	m.CNIRequests.WithLabelValues("ADD", "enrolled").Inc()
	_, body = get(t, base+"/metrics")
	for _, want := range []string{
		`ambient_cni_cni_requests_total{result="enrolled",verb="ADD"} 1`,
		"ambient_cni_cni_add_duration_seconds",
		"ambient_cni_enrolled_pods",
		"ambient_cni_ztunnel_connections",
		`ambient_cni_rule_errors_total{op="apply"} 0`,
		"ambient_cni_installer_reinstalls_total",
	} {
		if !strings.Contains(body, want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	if _, body := get(t, base+"/debug/pods"); !strings.Contains(body, `"uid-1": "enabled"`) {
		t.Errorf("/debug/pods = %q", body)
	}
	if code, _ := get(t, base+"/nope"); code != 404 {
		t.Errorf("unknown path = %d", code)
	}
	cancel()
	if err := <-errCh; err != nil {
		t.Fatalf("Serve returned %v", err)
	}
}
