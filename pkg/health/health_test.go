package health

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/metrics"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// peerHelperEnv makes the test binary a client of the debug socket named
// in it (run as another user by TestDebugRefusesNonRootPeer).
const peerHelperEnv = "AMBIENT_HEALTH_PEER_HELPER"

func TestMain(m *testing.M) {
	if sock := os.Getenv(peerHelperEnv); sock != "" {
		code, body, err := unixGet(sock, "/debug/pods")
		if err != nil {
			fmt.Println("ERR", err)
			os.Exit(3)
		}
		fmt.Println(code, body)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func unixGet(sock, path string) (int, string, error) {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", sock)
		},
	}}
	resp, err := c.Get("http://agent" + path)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// serveTCP serves h on a free loopback port until the test ends.
func serveTCP(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := ListenTCP("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	serve(t, ln, h)
	return "http://" + ln.Addr().String()
}

func serve(t *testing.T, ln net.Listener, h http.Handler) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errCh := make(chan error, 1)
	go func() { errCh <- ServeListener(ctx, ln, h) }()
	t.Cleanup(func() {
		cancel()
		if err := <-errCh; err != nil {
			t.Errorf("ServeListener: %v", err)
		}
	})
}

func testDebug() Debug {
	return Debug{
		Pods: func() any { return map[string]string{"uid-1": "enabled"} },
		Explain: func(_ context.Context, ns, name string) (any, error) {
			if ns == "shop" && name == "web" {
				return map[string]string{"verdict": "captured"}, nil
			}
			return nil, ErrNoSuchPod
		},
		ExplainAll: func(context.Context) any { return map[string]int{"pods": 1} },
	}
}

// TestHealthAndMetricsServeNothingElse: the health address (reachable by
// kubelet, and so by anything that reaches the node) answers /healthz and
// /readyz only, the metrics address /metrics only; neither serves the
// debug endpoints, which name pods, IPs and netns paths.
func TestHealthAndMetricsServeNothingElse(t *testing.T) {
	m := metrics.New()
	s := New()
	var configOK atomic.Bool
	configOK.Store(true)
	s.AddCheck("config", func() error {
		if !configOK.Load() {
			return errors.New("conflist lacks our entry")
		}
		return nil
	})
	hb := serveTCP(t, s.Handler())
	mb := serveTCP(t, MetricsHandler(m.Registry))

	if code, _ := get(t, hb+"/healthz"); code != 200 {
		t.Errorf("/healthz = %d", code)
	}
	if code, _ := get(t, hb+"/readyz"); code != 200 {
		t.Errorf("/readyz = %d while ready", code)
	}
	configOK.Store(false)
	code, body := get(t, hb+"/readyz")
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "config: conflist lacks our entry") {
		t.Errorf("/readyz = %d %q while config is missing", code, body)
	}
	m.CNIRequests.WithLabelValues("ADD", "enrolled").Inc()
	_, body = get(t, mb+"/metrics")
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
	for _, c := range []struct{ base, path string }{
		{hb, "/metrics"}, {hb, "/debug/pods"}, {hb, "/debug/explain"}, {hb, "/debug/explain?pod=shop/web"}, {hb, "/nope"},
		{mb, "/healthz"}, {mb, "/readyz"}, {mb, "/debug/pods"}, {mb, "/debug/explain"}, {mb, "/debug/explain?pod=shop/web"},
	} {
		if code, body := get(t, c.base+c.path); code != http.StatusNotFound {
			t.Errorf("%s on the %s listener = %d %q, want 404", c.path, map[bool]string{true: "health", false: "metrics"}[c.base == hb], code, body)
		}
	}
}

// TestDebugOnUnixSocket: the debug endpoints answer on a root-only socket
// (directory 0700, socket 0600) and go with it when serving stops.
func TestDebugOnUnixSocket(t *testing.T) {
	testnet.RequireRoot(t)
	sock := filepath.Join(t.TempDir(), "run", DebugSocketName)
	ln, err := ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	errCh := make(chan error, 1)
	go func() { errCh <- ServeListener(ctx, ln, testDebug().Handler()) }()
	for path, perm := range map[string]os.FileMode{filepath.Dir(sock): 0o700, sock: 0o600} {
		if st, err := os.Stat(path); err != nil || st.Mode().Perm() != perm {
			t.Errorf("%s: mode %v (%v), want %v", path, st.Mode().Perm(), err, perm)
		}
	}
	for _, c := range []struct {
		path string
		code int
		want string
	}{
		{"/debug/pods", 200, `"uid-1": "enabled"`},
		{"/debug/explain", 200, `"pods": 1`},
		{"/debug/explain?pod=shop/web", 200, `"verdict": "captured"`},
		{"/debug/explain?pod=shop/gone", 404, "no such pod"},
		{"/debug/explain?pod=web", 400, "<namespace>/<name>"},
		{"/debug/explain?pod=a/b/c", 400, "<namespace>/<name>"},
		{"/debug/explain?pod=" + strings.Repeat("a", 600) + "/b", 400, "<namespace>/<name>"},
		{"/healthz", 404, "try GET /debug/pods"},
	} {
		code, body, err := unixGet(sock, c.path)
		if err != nil || code != c.code || !strings.Contains(body, c.want) {
			t.Errorf("%s = %d %q (%v), want %d containing %q", c.path, code, body, err, c.code, c.want)
		}
	}
	cancel()
	if err := <-errCh; err != nil {
		t.Fatalf("ServeListener: %v", err)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("debug socket left behind: %v", err)
	}
}

// TestDebugRefusesNonRootPeer: even with the socket's modes loosened by
// hand, a peer that is not root (SO_PEERCRED) gets 403.
func TestDebugRefusesNonRootPeer(t *testing.T) {
	testnet.RequireRoot(t)
	shared, err := os.MkdirTemp("", "ambient-debug-peer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(shared) })
	sock := filepath.Join(shared, "run", DebugSocketName)
	ln, err := ListenUnix(sock)
	if err != nil {
		t.Fatal(err)
	}
	serve(t, ln, Debug{Pods: testDebug().Pods, Logger: slog.New(slog.DiscardHandler)}.Handler())
	for path, mode := range map[string]os.FileMode{shared: 0o755, filepath.Dir(sock): 0o755, sock: 0o666} {
		if err := os.Chmod(path, mode); err != nil {
			t.Fatal(err)
		}
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(shared, "peer-helper")
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Env = []string{peerHelperEnv + "=" + sock}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper as uid 65534: %v\n%s", err, out)
	}
	if !strings.HasPrefix(string(out), "403 ") || strings.Contains(string(out), "uid-1") {
		t.Errorf("non-root peer got %q, want 403 and no data", out)
	}
	if code, body, err := unixGet(sock, "/debug/pods"); err != nil || code != 200 || !strings.Contains(body, "uid-1") {
		t.Errorf("root peer: %d %q %v", code, body, err)
	}
}

// TestServeRetrying: a taken address is reported (not fatal) and retried;
// once free it is served; ctx ends it.
func TestServeRetrying(t *testing.T) {
	holder, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := holder.Addr().String()
	failed := make(chan error, 100)
	bound := make(chan string, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		ServeRetrying(ctx, addr, New().Handler(), Retry{
			Every:  10 * time.Millisecond,
			Bound:  func(a net.Addr) { bound <- a.String() },
			Failed: func(err error, _ int) { failed <- err },
		})
	}()
	select {
	case err := <-failed:
		if !strings.Contains(err.Error(), addr) {
			t.Errorf("failure %q does not name %s", err, addr)
		}
	case <-time.After(time.Minute):
		t.Fatal("a taken address was not reported")
	}
	_ = holder.Close()
	select {
	case got := <-bound:
		if got != addr {
			t.Errorf("bound %s, want %s", got, addr)
		}
	case <-time.After(time.Minute):
		t.Fatal("the address was not bound once free")
	}
	var code int
	deadline := time.Now().Add(time.Minute)
	for code != 200 && time.Now().Before(deadline) {
		if code, _ = get(t, "http://"+addr+"/healthz"); code != 200 {
			time.Sleep(10 * time.Millisecond)
		}
	}
	if code != 200 {
		t.Errorf("/healthz on the retried address = %d", code)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatal("ServeRetrying did not return after ctx ended")
	}
}
