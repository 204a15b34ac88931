package main

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// The fault endpoint refuses what it cannot act on: an unknown or missing
// pod, and any method but POST.
func TestCloseListenersEndpoint(t *testing.T) {
	mux := debugMux(ztunnel.New(ztunnel.Config{SocketPath: "/nonexistent/ztunnel.sock"}))
	for _, c := range []struct {
		method, target string
		want           int
	}{
		{http.MethodPost, "/close-listeners?uid=no-such-pod", http.StatusNotFound},
		{http.MethodPost, "/close-listeners", http.StatusNotFound},
		{http.MethodPost, "/close-listeners?uid=%zz", http.StatusNotFound},
		{http.MethodGet, "/close-listeners?uid=x", http.StatusMethodNotAllowed},
		{http.MethodGet, "/workloads", http.StatusOK},
	} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(c.method, c.target, nil))
		if rec.Code != c.want {
			t.Errorf("%s %s: %d, want %d", c.method, c.target, rec.Code, c.want)
		}
	}
}
