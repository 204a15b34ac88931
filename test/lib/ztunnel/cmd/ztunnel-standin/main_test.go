package main

import (
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// The fault endpoints refuse what they cannot act on: an unknown or
// missing pod, a pod not made deaf, and any other method. A refused
// POST /deaf leaves the stand-in not deaf to the pod.
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
		{http.MethodPost, "/deaf?uid=no-such-pod", http.StatusNotFound},
		{http.MethodDelete, "/deaf?uid=no-such-pod", http.StatusNotFound},
		{http.MethodGet, "/deaf?uid=x", http.StatusMethodNotAllowed},
	} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(c.method, c.target, nil))
		if rec.Code != c.want {
			t.Errorf("%s %s: %d, want %d", c.method, c.target, rec.Code, c.want)
		}
	}
}
