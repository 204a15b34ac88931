// Package health serves install-cni's operational endpoints, each only
// where its audience can reach it:
//
//   - /healthz (alias /livez) and /readyz (Handler), which kubelet probes:
//     they say ok, or which liveness or readiness check fails, and nothing
//     about any pod. They are always served on the root-only debug socket, which the
//     chart's exec probes ask (install-cni probe), so the agent needs no
//     host port to be probed; a TCP health address is optional and off by
//     default;
//   - /metrics (MetricsHandler) on its own address, for Prometheus: counts
//     and gauges, no pod names. ServeRetrying serves it: a taken port is
//     reported and retried, never fatal;
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
	"maps"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/ambient-cni/ambient-cni/pkg/unixsock"
)

// DefaultAddr is the TCP address of /healthz and /readyz unless told
// otherwise: none. The agent runs in the host network, so any TCP port is a
// host port another hostNetwork pod (an Istio gateway holds 15021) may
// take first; kubelet probes the debug socket instead.
const DefaultAddr = ""

// DefaultMetricsPort is the port of /metrics unless told otherwise: one of
// our own, clear of every port Istio's components use (15000-15090), so
// ambient-cni and an Istio install never compete for it on a node.
const DefaultMetricsPort = 9974

// DefaultMetricsAddr is where install-cni serves /metrics unless told
// otherwise.
var DefaultMetricsAddr = ":" + strconv.Itoa(DefaultMetricsPort)

// Check reports nil when its part of the agent is ready.
type Check func() error

// LiveCheck reports nil when its part of the agent answers; it gives up
// when ctx ends.
type LiveCheck func(ctx context.Context) error

// LiveTimeout bounds the liveness checks of one /livez request, inside the
// 4 s install-cni probe waits for the answer: a hung part is reported as
// such, not as a probe that timed out.
const LiveTimeout = 3 * time.Second

// Server holds the readiness and liveness checks. Add checks before
// serving.
type Server struct {
	mu     sync.Mutex
	checks map[string]Check
	// capture are the checks only readiness to capture adds (CaptureReady).
	capture map[string]Check
	live    map[string]LiveCheck
}

// New returns a server with no checks.
func New() *Server {
	return &Server{checks: map[string]Check{}, capture: map[string]Check{}, live: map[string]LiveCheck{}}
}

// AddLiveCheck registers a named liveness check: /healthz and /livez fail
// while it does.
func (s *Server) AddLiveCheck(name string, c LiveCheck) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.live[name] = c
}

// Live runs every liveness check, together bounded by LiveTimeout and
// ctx, and returns the failures, sorted by name.
func (s *Server) Live(ctx context.Context) []string {
	s.mu.Lock()
	names := make([]string, 0, len(s.live))
	for n := range s.live {
		names = append(names, n)
	}
	checks := maps.Clone(s.live)
	s.mu.Unlock()
	sort.Strings(names)
	ctx, cancel := context.WithTimeout(ctx, LiveTimeout)
	defer cancel()
	var failed []string
	for _, n := range names {
		if err := checks[n](ctx); err != nil {
			failed = append(failed, fmt.Sprintf("%s: %v", n, err))
		}
	}
	return failed
}

// AddCheck registers a named readiness check.
func (s *Server) AddCheck(name string, c Check) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.checks[name] = c
}

// AddCaptureCheck registers a named check that readiness to capture
// (CaptureReady) needs on top of the readiness checks, but /readyz does
// not: the agent's pod is ready without it (ztunnel may be installed after
// the agent, e.g. by a helm install that waits for the agent's pods).
func (s *Server) AddCaptureCheck(name string, c Check) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.capture[name] = c
}

// Ready runs every readiness check (what /readyz reports) and returns the
// failures, sorted by name.
func (s *Server) Ready() []string { return s.run(false) }

// CaptureReady runs every readiness check and every capture check and
// returns the failures, sorted by name: empty means the node's pods can be
// captured now (what the node's startup taint waits for).
func (s *Server) CaptureReady() []string { return s.run(true) }

func (s *Server) run(capture bool) []string {
	s.mu.Lock()
	names := make([]string, 0, len(s.checks)+len(s.capture))
	checks := make(map[string]Check, len(s.checks)+len(s.capture))
	for n, c := range s.checks {
		names = append(names, n)
		checks[n] = c
	}
	if capture {
		for n, c := range s.capture {
			if _, dup := checks[n]; !dup {
				names = append(names, n)
			}
			checks[n] = c
		}
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

// Handler serves /healthz (and /livez, the same), /readyz, and nothing
// else.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	s.register(mux)
	return mux
}

// Paths are the endpoints Handler serves.
var Paths = []string{"/healthz", "/livez", "/readyz"}

func (s *Server) register(mux *http.ServeMux) {
	live := func(w http.ResponseWriter, r *http.Request) {
		if failed := s.Live(r.Context()); len(failed) > 0 {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("not live:\n" + strings.Join(failed, "\n") + "\n"))
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	}
	mux.HandleFunc("GET /healthz", live)
	mux.HandleFunc("GET /livez", live)
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		if failed := s.Ready(); len(failed) > 0 {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte("not ready:\n" + strings.Join(failed, "\n") + "\n"))
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
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
	// Health, when set, is also served here (/healthz, /livez, /readyz):
	// what install-cni probe asks for kubelet's exec probes.
	Health *Server
	Logger *slog.Logger
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
	if d.Health != nil {
		d.Health.register(mux)
	}
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

// Retry says how ServeRetrying reports and retries.
type Retry struct {
	// Every is the wait between attempts to listen; zero is 30 seconds.
	Every time.Duration
	// Bound, when set, is told each bound address.
	Bound func(net.Addr)
	// Failed, when set, is told each failure to listen or serve; attempt
	// counts the failures so far, from 1.
	Failed func(err error, attempt int)
}

// ServeRetrying serves h on the TCP address addr until ctx ends, and
// never fails: when addr cannot be bound (another process holds the port)
// or serving stops with an error, r.Failed is told and the address is tried
// again after r.Every. For what is optional to the agent, like /metrics: a
// taken port must not stop the node agent that pods need.
func ServeRetrying(ctx context.Context, addr string, h http.Handler, r Retry) {
	every := r.Every
	if every <= 0 {
		every = 30 * time.Second
	}
	for attempt := 1; ctx.Err() == nil; {
		err := func() error {
			ln, err := ListenTCP(addr)
			if err != nil {
				return err
			}
			if r.Bound != nil {
				r.Bound(ln.Addr())
			}
			return ServeListener(ctx, ln, h)
		}()
		if err == nil || ctx.Err() != nil {
			return
		}
		if r.Failed != nil {
			r.Failed(err, attempt)
		}
		attempt++
		t := time.NewTimer(every)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}
