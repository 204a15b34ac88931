// Package health serves install-cni's operational endpoints, each only
// where its audience can reach it:
//
//   - /healthz and /readyz (Handler) on the health address, which kubelet
//     probes: they say ok, or which readiness check fails, and nothing
//     about any pod;
//   - /metrics (MetricsHandler) on its own address, for Prometheus: counts
//     and gauges, no pod names;
//   - /debug/pods and /debug/explain (Debug) only on a root-only Unix socket
//     in the agent's private directory (ServeUnix): they name pods, UIDs,
//     IPs and netns paths, so no pod and nothing on the network may read
//     them.
package health

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ambient-cni/ambient-cni/pkg/unixsock"
)

// DefaultAddr is where install-cni serves /healthz and /readyz unless told
// otherwise (the port Istio's node components use for health).
const DefaultAddr = ":15021"

// DefaultMetricsAddr is where install-cni serves /metrics unless told
// otherwise (the port Istio's CNI node agent exports its metrics on).
const DefaultMetricsAddr = ":15014"

// Check reports nil when its part of the agent is ready.
type Check func() error

// Server holds the readiness checks. Add checks before serving.
type Server struct {
	mu     sync.Mutex
	checks map[string]Check
}

// New returns a server with no checks.
func New() *Server {
	return &Server{checks: map[string]Check{}}
}

// AddCheck registers a named readiness check.
func (s *Server) AddCheck(name string, c Check) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.checks[name] = c
}

// Ready runs every check and returns the failures, sorted by name.
func (s *Server) Ready() []string {
	s.mu.Lock()
	names := make([]string, 0, len(s.checks))
	checks := make(map[string]Check, len(s.checks))
	for n, c := range s.checks {
		names = append(names, n)
		checks[n] = c
	}
	s.mu.Unlock()
	sort.Strings(names)
	var failed []string
	for _, n := range names {
		if err := checks[n](); err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", n, err))
		}
	}
	return failed
}

// Handler serves /healthz and /readyz, and nothing else.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if failed := s.Ready(); len(failed) > 0 {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("not ready:\n" + strings.Join(failed, "\n") + "\n"))
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}

// MetricsHandler serves registry on /metrics, and nothing else.
func MetricsHandler(registry *prometheus.Registry) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(registry, promhttp.HandlerOpts{Registry: registry}))
	return mux
}

// ErrNoSuchPod is what Debug.Explain returns for a pod it knows nothing
// about; the endpoint answers 404.
var ErrNoSuchPod = errors.New("no such pod on this node")

// Debug is the debug endpoints' data. Each function's result is sent as
// indented JSON.
type Debug struct {
	// Pods is the agent's enrolled-pod state (/debug/pods).
	Pods func() any
	// Explain answers why one pod is or is not captured
	// (/debug/explain?pod=<namespace>/<name>).
	Explain func(ctx context.Context, namespace, name string) (any, error)
	// ExplainAll explains every pod of the node (/debug/explain).
	ExplainAll func(ctx context.Context) any
	Logger     *slog.Logger
}

// Handler serves /debug/pods and /debug/explain to root peers only (serve
// it with ServeUnix).
func (d Debug) Handler() http.Handler {
	log := d.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	send := func(w http.ResponseWriter, code int, v any) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.SetEscapeHTML(false) // read by people: keep <, > and & as they are
		if err := enc.Encode(v); err != nil {
			log.Warn("encode debug answer", "err", err)
		}
	}
	fail := func(w http.ResponseWriter, code int, msg string) {
		send(w, code, map[string]string{"error": msg})
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/pods", func(w http.ResponseWriter, _ *http.Request) {
		send(w, http.StatusOK, d.Pods())
	})
	mux.HandleFunc("GET /debug/explain", func(w http.ResponseWriter, r *http.Request) {
		pod := r.URL.Query().Get("pod")
		if pod == "" {
			send(w, http.StatusOK, d.ExplainAll(r.Context()))
			return
		}
		ns, name, ok := strings.Cut(pod, "/")
		if !ok || ns == "" || name == "" || strings.Contains(name, "/") || len(pod) > 512 {
			if len(pod) > 80 {
				pod = pod[:80] + "..."
			}
			fail(w, http.StatusBadRequest, fmt.Sprintf("pod %q: want <namespace>/<name>", pod))
			return
		}
		v, err := d.Explain(r.Context(), ns, name)
		switch {
		case errors.Is(err, ErrNoSuchPod):
			fail(w, http.StatusNotFound, fmt.Sprintf("pod %s/%s: %v", ns, name, err))
		case err != nil:
			fail(w, http.StatusInternalServerError, err.Error())
		default:
			send(w, http.StatusOK, v)
		}
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fail(w, http.StatusNotFound, fmt.Sprintf("no such endpoint %s %s; try GET /debug/pods, /debug/explain or /debug/explain?pod=<namespace>/<name>", r.Method, r.URL.Path))
	})
	return unixsock.RootOnly(mux, log, func(w http.ResponseWriter, _ *http.Request, _ error) {
		fail(w, http.StatusForbidden, "only root may use the debug socket")
	})
}

// ListenTCP listens on addr for ServeListener.
func ListenTCP(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", addr, err)
	}
	return ln, nil
}

// ListenUnix listens on a root-only Unix socket at path (directory 0700,
// socket 0600, a stale socket replaced) for ServeListener.
func ListenUnix(path string) (net.Listener, error) {
	return unixsock.Listen(unixsock.Config{Path: path, Net: "unix", Mode: 0o600, PrivateDir: true})
}

// ServeListener serves h on ln until ctx ends, then shuts down and closes
// ln (a Unix socket's file goes with it). On a Unix socket each request
// carries its peer's credentials for Debug's root check (unixsock.RootOnly).
func ServeListener(ctx context.Context, ln net.Listener, h http.Handler) error {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       60 * time.Second,
		MaxHeaderBytes:    8 << 10,
		ConnContext:       unixsock.ConnContext,
	}
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-ctx.Done():
			shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(shut)
		case <-done:
		}
	}()
	err := srv.Serve(ln)
	_ = ln.Close()
	if err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve on %s: %w", ln.Addr(), err)
	}
	return nil
}
