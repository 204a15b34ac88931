package unixsock

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func refuseWith(w http.ResponseWriter, _ *http.Request, why error) {
	http.Error(w, why.Error(), http.StatusForbidden)
}

var ok = http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })

// TestRootOnlyUnknownPeer: a request whose peer was not recorded (no
// ConnContext, or not a Unix socket) is refused.
func TestRootOnlyUnknownPeer(t *testing.T) {
	h := RootOnly(ok, slog.New(slog.DiscardHandler), refuseWith)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/", nil))
	if rec.Code != http.StatusForbidden || !strings.Contains(rec.Body.String(), "peer credentials unavailable") {
		t.Errorf("no recorded peer: %d %q", rec.Code, rec.Body)
	}
	tcp := &net.TCPConn{}
	req := httptest.NewRequest("GET", "/", nil).WithContext(ConnContext(context.Background(), tcp))
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	if rec.Code != http.StatusForbidden || !strings.Contains(rec.Body.String(), "not a unix socket") {
		t.Errorf("TCP peer: %d %q", rec.Code, rec.Body)
	}
}

// TestRootOnlyOverSocket: over a real Unix socket the peer is this
// process; it is served when it is root and refused, naming its uid,
// otherwise. (The packages serving with RootOnly test a non-root peer
// under another uid.)
func TestRootOnlyOverSocket(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.sock")
	ln, err := Listen(Config{Path: path, Net: "unix", Mode: 0o600})
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: RootOnly(ok, slog.New(slog.DiscardHandler), refuseWith), ConnContext: ConnContext}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	t.Cleanup(func() {
		_ = srv.Close()
		if err := <-done; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("serve: %v", err)
		}
	})
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}}}
	resp, err := c.Get("http://unix/")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if os.Geteuid() == 0 {
		if resp.StatusCode != http.StatusOK || string(body) != "ok" {
			t.Errorf("root peer: %d %q", resp.StatusCode, body)
		}
	} else if resp.StatusCode != http.StatusForbidden || !strings.Contains(string(body), "is not root") {
		t.Errorf("non-root peer: %d %q", resp.StatusCode, body)
	}
}
