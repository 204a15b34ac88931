// Package health serves install-cni's operational endpoints, with the
// readiness checks install-cni registers: /healthz (the process is alive),
// /readyz (every readiness check passes), /metrics and /debug/pods.
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
)

// DefaultAddr is where install-cni serves the endpoints unless told
// otherwise (the port Istio's node components use for health).
const DefaultAddr = ":15021"

// Check reports nil when its part of the agent is ready.
type Check func() error

// Server serves the endpoints. Add checks before Serve.
type Server struct {
	log      *slog.Logger
	registry *prometheus.Registry
	debug    func() any

	mu     sync.Mutex
	checks map[string]Check
}

// New returns a server exporting registry on /metrics and the value debug
// returns (marshalled as JSON) on /debug/pods; either may be nil.
func New(log *slog.Logger, registry *prometheus.Registry, debug func() any) *Server {
	return &Server{log: log, registry: registry, debug: debug, checks: map[string]Check{}}
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
	for n := range s.checks {
		names = append(names, n)
	}
	checks := make(map[string]Check, len(s.checks))
	for n, c := range s.checks {
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

// Handler returns the HTTP handler with every endpoint.
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
	if s.registry != nil {
		mux.Handle("GET /metrics", promhttp.HandlerFor(s.registry, promhttp.HandlerOpts{Registry: s.registry}))
	}
	if s.debug != nil {
		mux.HandleFunc("GET /debug/pods", func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			enc := json.NewEncoder(w)
			enc.SetIndent("", "  ")
			if err := enc.Encode(s.debug()); err != nil {
				s.log.Warn("encode /debug/pods", "err", err)
			}
		})
	}
	return mux
}

// Serve listens on addr until ctx ends. ready, when non-nil, receives the
// bound address (useful with port 0).
func (s *Server) Serve(ctx context.Context, addr string, ready func(net.Addr)) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", addr, err)
	}
	if ready != nil {
		ready(ln.Addr())
	}
	srv := &http.Server{
		Handler:           s.Handler(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      30 * time.Second,
		IdleTimeout:       60 * time.Second,
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
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serve health on %s: %w", addr, err)
	}
	return nil
}
