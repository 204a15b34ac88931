package nodeagent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/unixsock"
)

// ServerConfig configures the plugin event server. Zero values take the
// defaults.
type ServerConfig struct {
	// Layout is the agent's run directory (required): the server listens
	// on its AgentSocket, keeps its Heartbeat fresh and re-checks its
	// AddSpool. The directory is created (or tightened) to 0700, the
	// socket is 0600.
	Layout nodefiles.Layout
	// Netns decides which netns paths from the plugin are accepted: nsfs
	// mounts below its roots (nil: netns.DefaultRoots) and
	// /proc/<pid>/ns/net, opened below its ProcRoot. Give it the agent's
	// policy (Config.Netns): both judge the runtime's paths alike.
	Netns netns.Policy
	// HandlerTimeout bounds the work for one request: give it
	// ambient.HandlerTimeout of the plugin's timeout, so the plugin gets an
	// answer, not a timeout (default: that of ambient.DefaultPluginTimeout).
	HandlerTimeout time.Duration
	// ReadHeaderTimeout, ReadTimeout and IdleTimeout bound slow clients
	// (defaults 2s, 5s, 10s).
	ReadHeaderTimeout, ReadTimeout, IdleTimeout time.Duration
	// ControlPlaneNamespaces ("prefix-*" entries match by prefix) never
	// wait on the API server: an ADD of a pod the cache does not hold,
	// while the API server cannot be asked, starts it uncaptured unless
	// the cache shows its namespace enabled, recorded in the ADD spool to
	// be decided again, as the plugin does without the agent. Empty: every
	// such pod waits (fail-closed).
	ControlPlaneNamespaces []string
	// Observe, when set, is told about every request: verb (ADD, DEL,
	// CHECK, GC, STATUS), result (enrolled, not-enrolled, removed, ok,
	// retry, error, rejected, mismatch) and handling time. Wire metrics
	// here.
	Observe func(verb, result string, took time.Duration)
	// Logger receives structured logs (default: discarded).
	Logger *slog.Logger
}

func (c ServerConfig) withDefaults() ServerConfig {
	if c.HandlerTimeout <= 0 {
		c.HandlerTimeout = ambient.HandlerTimeout(ambient.DefaultPluginTimeout)
	}
	if c.ReadHeaderTimeout <= 0 {
		c.ReadHeaderTimeout = 2 * time.Second
	}
	if c.ReadTimeout <= 0 {
		c.ReadTimeout = 5 * time.Second
	}
	if c.IdleTimeout <= 0 {
		c.IdleTimeout = 10 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Decider answers the CNI path's question: should this pod be captured?
// It returns the pod too (pkg/podcache.Cache); an error wrapping
// enablement.ErrUnanswered says the API server could not be asked about a
// pod the cache does not hold.
type Decider interface {
	Decide(ctx context.Context, namespace, name, uid string) (enablement.Decision, *corev1.Pod, error)
	// NamespaceEnabled reports whether the cache shows the namespace
	// enabling pods whatever their own labels.
	NamespaceEnabled(namespace string) bool
}

// Server is the plugin event server: HTTP+JSON on a root-only Unix socket.
// For each ADD it decides with the pod cache, then captures through the
// agent; CHECK, DEL and GC go to the agent likewise.
type Server struct {
	cfg     ServerConfig
	decider Decider
	agent   *Agent
	netns   netns.Policy
	log     *slog.Logger
	http    *http.Server
	mu      sync.Mutex
	ln      *unixsock.Listener // closing it removes the socket file while it is ours
	closed  bool

	closeOnce sync.Once
	closeErr  error
}

// NewServer returns a server that decides with decider and hands pods to
// agent.
func NewServer(cfg ServerConfig, decider Decider, agent *Agent) *Server {
	cfg = cfg.withDefaults()
	s := &Server{cfg: cfg, decider: decider, agent: agent, netns: cfg.Netns, log: cfg.Logger.With("component", "event-server")}
	mux := http.NewServeMux()
	mux.HandleFunc(ambient.PathPodEvent, s.handlePodEvent)
	mux.HandleFunc(ambient.PathStatus, s.handleStatus)
	mux.HandleFunc(ambient.PathGC, s.handleGC)
	mux.HandleFunc(ambient.PathPluginLog, s.handlePluginLog)
	// Anything else (a plugin of another version, a stray client) gets a
	// JSON answer the plugin can read, not net/http's plain-text 404.
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		reply(w, http.StatusNotFound, ambient.PodEventResponse{Error: fmt.Sprintf("no such endpoint %s %s", r.Method, r.URL.Path)})
	})
	s.http = &http.Server{
		Handler: unixsock.RootOnly(mux, s.log, func(w http.ResponseWriter, _ *http.Request, why error) {
			reply(w, http.StatusForbidden, ambient.PodEventResponse{Error: why.Error() + "; only root may use this socket"})
		}),
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		ReadTimeout:       cfg.ReadTimeout,
		WriteTimeout:      cfg.HandlerTimeout + 5*time.Second,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    8 << 10,
		ConnContext:       unixsock.ConnContext,
		ErrorLog:          slog.NewLogLogger(cfg.Logger.Handler(), slog.LevelDebug),
	}
	return s
}

// Socket is the path the server listens on.
func (s *Server) Socket() string { return s.cfg.Layout.AgentSocket() }

// Listen makes the socket directory root-only (0700), replaces a stale
// socket file (never any other kind of file) and listens (socket 0600).
func (s *Server) Listen() error {
	if s.Socket() == "" {
		// No default: it would be the real node's socket.
		return errors.New("nodeagent: ServerConfig.Layout is required")
	}
	ln, err := unixsock.Listen(unixsock.Config{Path: s.Socket(), Net: "unix", Mode: 0o600, PrivateDir: true})
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		_ = ln.Close()
		return http.ErrServerClosed
	}
	s.ln = ln
	return nil
}

// Answering makes one STATUS round trip through the socket, dialled by
// its path as the plugin dials it: nil once the server accepted, read and
// answered the request within ctx. STATUS touches no rules and no pod, so
// it proves the serving loop alive without adding work (the agent's
// liveness check and watchdog).
func (s *Server) Answering(ctx context.Context) error {
	return (&ambient.Client{Socket: s.Socket()}).Status(ctx)
}

// Listening reports whether Listen succeeded.
func (s *Server) Listening() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ln != nil && !s.closed
}

// Serve answers requests until ctx ends or Close is called; it then shuts
// down gracefully (in-flight requests get HandlerTimeout to finish) and
// removes the socket before returning. Call Listen first.
func (s *Server) Serve(ctx context.Context) error {
	s.mu.Lock()
	ln := s.ln
	s.mu.Unlock()
	if ln == nil {
		return errors.New("event server: Serve before Listen")
	}
	stop := context.AfterFunc(ctx, func() { _ = s.Close() })
	defer stop()
	kctx, kcancel := context.WithCancel(ctx)
	kdone := make(chan struct{})
	go func() { defer close(kdone); s.keepAlive(kctx) }()
	defer func() { kcancel(); <-kdone }()
	err := s.http.Serve(ln)
	// Whatever ended serving, finish the shutdown (or wait for the one in
	// progress) so the socket is gone when Serve returns.
	cerr := s.Close()
	if errors.Is(err, http.ErrServerClosed) {
		return cerr
	}
	return err
}

// Close stops the server, waiting up to HandlerTimeout for in-flight
// requests, and removes the socket. Concurrent and repeated calls all wait
// for the one shutdown.
func (s *Server) Close() error {
	s.closeOnce.Do(func() {
		s.mu.Lock()
		s.closed = true
		ln := s.ln
		s.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), s.cfg.HandlerTimeout)
		defer cancel()
		err := s.http.Shutdown(ctx)
		if err != nil {
			err = s.http.Close()
		}
		if ln != nil {
			// Shutdown closed it if Serve ran; closing again is harmless.
			_ = ln.Close()
		}
		s.closeErr = err
	})
	return s.closeErr
}

func reply(w http.ResponseWriter, code int, resp ambient.PodEventResponse) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(resp)
}

// readBody reads a POST body of at most MaxRequestBytes.
func readBody(w http.ResponseWriter, r *http.Request) ([]byte, int, error) {
	if r.Method != http.MethodPost {
		return nil, http.StatusMethodNotAllowed, fmt.Errorf("method %s not allowed; use POST", r.Method)
	}
	b, err := io.ReadAll(http.MaxBytesReader(w, r.Body, ambient.MaxRequestBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, http.StatusRequestEntityTooLarge, fmt.Errorf("request body exceeds %d bytes", ambient.MaxRequestBytes)
		}
		return nil, http.StatusBadRequest, fmt.Errorf("read request: %w", err)
	}
	return b, 0, nil
}

func (s *Server) handlePodEvent(w http.ResponseWriter, r *http.Request) {
	t := newPhaseTimer(s.log)
	b, code, err := readBody(w, r)
	if err != nil {
		s.log.Warn("bad pod event", "err", err)
		s.observe("invalid", "rejected", 0)
		reply(w, code, ambient.PodEventResponse{Error: err.Error()})
		return
	}
	ev, err := ambient.DecodePodEvent(b)
	if err != nil {
		s.log.Warn("bad pod event", "err", err)
		s.observe("invalid", "rejected", 0)
		reply(w, http.StatusBadRequest, ambient.PodEventResponse{Error: err.Error()})
		return
	}
	t.lap("read")
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.HandlerTimeout)
	defer cancel()
	start := time.Now()
	verdict, err := s.dispatch(ctx, ev, t)
	took := time.Since(start)
	log := s.log.With("cmd", ev.Command, "pod", ev.PodNamespace+"/"+ev.PodName, "sandbox", ev.SandboxID, "took", took)
	if err != nil {
		code, result := statusOf(err)
		s.observe(string(ev.Command), result, took)
		log.Warn("pod event failed", "err", err, "retryable", IsRetryable(err))
		reply(w, code, ambient.PodEventResponse{Error: err.Error(), Retryable: IsRetryable(err)})
		return
	}
	s.observe(string(ev.Command), string(verdict), took)
	log.Debug("pod event done", "verdict", verdict)
	reply(w, http.StatusOK, ambient.PodEventResponse{Verdict: verdict})
	if verdict == ambient.VerdictEnrolled && ev.Command == ambient.CommandAdd {
		t.lap("reply")
		t.log(log, captureTimings)
	}
}

// statusOf maps a request's failure to the HTTP status that names its
// side, and the metrics result: 400 the caller's request can never succeed
// (the plugin answers CNI error 4), 409 a CHECK found the pod's capture
// wrong, 503 retrying may help (CNI error 11), 500 the agent failed.
func statusOf(err error) (int, string) {
	var result string
	switch {
	case IsInvalid(err):
		result = "rejected"
	case IsRetryable(err):
		result = "retry"
	case IsMismatch(err):
		result = "mismatch"
	default:
		result = "error"
	}
	return ResultStatus(result), result
}

// ResultStatus is the HTTP status the server answers a request with, by
// the result Observe is told: see statusOf; every other result is 200.
func ResultStatus(result string) int {
	switch result {
	case "rejected":
		return http.StatusBadRequest
	case "retry":
		return http.StatusServiceUnavailable
	case "mismatch":
		return http.StatusConflict
	case "error":
		return http.StatusInternalServerError
	}
	return http.StatusOK
}

// dispatch answers one decoded event; t times an ADD's phases.
func (s *Server) dispatch(ctx context.Context, ev *ambient.PodEvent, t *phaseTimer) (ambient.Verdict, error) {
	if ev.Command == ambient.CommandDel {
		// DEL never opens the netns: the agent holds its own handle, and
		// the runtime may already have removed the mount. The path only
		// tells which sandbox a controller-captured pod's DEL names.
		return ambient.VerdictRemoved, s.agent.RemoveSandbox(ctx, SandboxDel{
			SandboxID: ev.SandboxID, UID: types.UID(ev.PodUID), Namespace: ev.PodNamespace, Name: ev.PodName, Netns: ev.Netns,
		})
	}
	p := podInfo(ev)
	if ev.Command == ambient.CommandCheck {
		return ambient.VerdictOK, s.checkPath(ctx, p, ev.Netns)
	}
	v, err := s.addPath(ctx, p, ev.Netns, t)
	if why := s.unseenControlPlane(p, err); why != "" {
		if serr := nodefiles.Spool(s.cfg.Layout.AddSpool(), *ev); serr != nil {
			// The pod controller still decides the pod once the cache
			// holds it; the spool only puts it first.
			s.log.Error("could not record the pod to decide again", "pod", p.Namespace+"/"+p.Name, "err", serr)
		}
		s.log.Warn("pod starts uncaptured, recorded to be decided again", "pod", p.Namespace+"/"+p.Name, "sandbox", p.SandboxID, "reason", why)
		return ambient.VerdictNotEnrolled, nil
	}
	return v, err
}

// unseenControlPlane says why a pod whose decision failed may start
// uncaptured ("" when it may not): the cache does not hold it, the API
// server cannot be asked, and its namespace is one of the control plane's
// the cache does not show enabled. The plugin's snapshot tier decides
// such a pod the same way while the agent cannot answer; without this the
// control plane would wait on the API server whenever the cache lags.
func (s *Server) unseenControlPlane(p PodInfo, err error) string {
	if err == nil || !errors.Is(err, enablement.ErrUnanswered) || !ambient.InNamespaces(s.cfg.ControlPlaneNamespaces, p.Namespace) ||
		s.decider.NamespaceEnabled(p.Namespace) {
		return ""
	}
	return fmt.Sprintf("%v; namespace %q is the control plane's and not enabled per the agent's cache", err, p.Namespace)
}

// podInfo is the pod a CNI event names.
func podInfo(ev *ambient.PodEvent) PodInfo {
	return PodInfo{Namespace: ev.PodNamespace, Name: ev.PodName, UID: types.UID(ev.PodUID), SandboxID: ev.SandboxID, IPs: ev.Addrs(), Network: ev.Network}
}

// addPath is the CNI ADD with the runtime's netns path: the path is opened
// (and so validated against the allowed roots) only for a pod that will be
// captured, so a wrong netns root setting never stops the pods that stay
// outside the mesh.
// t, when not nil, times the phases.
func (s *Server) addPath(ctx context.Context, p PodInfo, path string, t *phaseTimer) (ambient.Verdict, error) {
	d, pod, err := s.decide(ctx, p)
	if err != nil {
		return "", err
	}
	if !d.Enroll {
		s.log.Info("pod not enrolled", "pod", p.Namespace+"/"+p.Name, "sandbox", p.SandboxID, "reason", d.Reason)
		return ambient.VerdictNotEnrolled, nil
	}
	t.lap("decide")
	ns, err := s.netns.Open(path)
	if err != nil {
		return "", err
	}
	t.lap("open")
	return s.capture(ctx, p, d, pod, ns, t)
}

// decide is the enablement decision for the pod of a CNI request, with
// the pod; a pod of another uid than the runtime's is retryable (the cache
// lags).
func (s *Server) decide(ctx context.Context, p PodInfo) (enablement.Decision, *corev1.Pod, error) {
	d, pod, err := s.decider.Decide(ctx, p.Namespace, p.Name, string(p.UID))
	if err != nil {
		return d, nil, Retryable(fmt.Errorf("decide on pod %s/%s: %w", p.Namespace, p.Name, err))
	}
	if pod != nil && p.UID != "" && pod.UID != p.UID {
		return d, nil, Retryable(fmt.Errorf("pod %s/%s is uid %s, the runtime asked for %s", p.Namespace, p.Name, pod.UID, p.UID))
	}
	return d, pod, nil
}

// capture enrolls a pod decided in; it takes ownership of ns. t, when not
// nil, goes on timing the request's phases.
func (s *Server) capture(ctx context.Context, p PodInfo, d enablement.Decision, pod *corev1.Pod, ns *netns.Handle, t *phaseTimer) (ambient.Verdict, error) {
	if err := s.agent.capture(ctx, pod, ns, &Sandbox{ID: p.SandboxID, IPs: p.IPs, Network: p.Network}, t); err != nil {
		return "", err
	}
	s.log.Info("pod enrolled", "pod", p.Namespace+"/"+p.Name, "sandbox", p.SandboxID, "reason", d.Reason, "uid", pod.UID)
	return ambient.VerdictEnrolled, nil
}

// checkPath is the CNI CHECK with the runtime's netns path, opened only
// when there is something to compare it with: a pod decided out and not
// enrolled passes without it.
func (s *Server) checkPath(ctx context.Context, p PodInfo, path string) error {
	d, pod, err := s.decider.Decide(ctx, p.Namespace, p.Name, string(p.UID))
	if err != nil {
		if s.unseenControlPlane(p, err) != "" && s.agent.get(p.UID) == nil {
			// As ADD decided: started uncaptured, to be decided again.
			return nil
		}
		return Retryable(fmt.Errorf("decide on pod %s/%s: %w", p.Namespace, p.Name, err))
	}
	if p.UID == "" && pod != nil {
		p.UID = pod.UID
	}
	if !d.Enroll && s.agent.get(p.UID) == nil {
		return nil
	}
	ns, err := s.netns.Open(path)
	if err != nil {
		return err
	}
	return s.agent.Check(ctx, p, d, ns)
}

// keepAlive refreshes the heartbeat next to the socket while the server
// serves, so the plugin knows for how long the agent has been gone, and
// re-checks the pods the plugin let through while it was: first thing,
// then at every beat. A round of re-checks gets one beat, so a slow one
// (no ztunnel yet) never leaves the heartbeat stale for long.
func (s *Server) keepAlive(ctx context.Context) {
	hb := s.cfg.Layout.Heartbeat()
	t := time.NewTicker(nodefiles.HeartbeatInterval)
	defer t.Stop()
	for {
		if err := nodefiles.TouchHeartbeat(hb, time.Now()); err != nil {
			s.log.Warn("refresh heartbeat", "err", err)
		}
		rctx, cancel := context.WithTimeout(ctx, nodefiles.HeartbeatInterval)
		if _, err := s.RecheckPassedThrough(rctx); err != nil {
			s.log.Warn("re-check pods started without the agent", "err", err)
		}
		cancel()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// RecheckPassedThrough decides again on each pod the plugin let start
// uncaptured while the agent was gone (the ADD spool next to the socket)
// and captures those that should be. An entry is removed once handled:
// captured, decided out, or its pod or namespace gone; one whose capture
// may succeed later is kept for the next round. It returns how many pods
// it captured.
func (s *Server) RecheckPassedThrough(ctx context.Context) (int, error) {
	entries, err := nodefiles.ListAdds(s.cfg.Layout.AddSpool())
	if err != nil {
		return 0, err
	}
	return drainSpool(s.log, "ADD spool", entries, func(ev *ambient.PodEvent) spoolStep {
		p := podInfo(ev)
		log := s.log.With("pod", p.Namespace+"/"+p.Name, "sandbox", p.SandboxID)
		v, err := s.addPath(ctx, p, ev.Netns, nil)
		switch {
		case err == nil && v == ambient.VerdictEnrolled:
			log.Warn("pod started while the agent was gone is now captured")
			return spoolCounted
		case err == nil:
			return spoolDone
		case IsInvalid(err) || apierrors.IsNotFound(err):
			// Its sandbox or the pod itself is gone.
			log.Info("pod started while the agent was gone needs no re-check", "err", err)
			return spoolDone
		default:
			// A netns that is gone comes back invalid (above); the path is
			// the plugin's, which the agent may only reach under its proc
			// root, so it is not looked at here.
			log.Warn("re-check of a pod started while the agent was gone failed; will retry", "err", err)
			return spoolKeep
		}
	}), nil
}

func (s *Server) handleStatus(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		reply(w, http.StatusMethodNotAllowed, ambient.PodEventResponse{Error: "method not allowed; use GET"})
		return
	}
	s.observe("STATUS", string(ambient.VerdictOK), 0)
	reply(w, http.StatusOK, ambient.PodEventResponse{Verdict: ambient.VerdictOK})
}

func (s *Server) observe(verb, result string, took time.Duration) {
	if s.cfg.Observe != nil {
		s.cfg.Observe(verb, result, took)
	}
}

// handlePluginLog writes the plugin's own log records of one call into the
// agent's log (component cni-plugin), so kubectl logs of the node's agent
// shows why a sandbox failed on the plugin's side too, as istio-cni's
// agent does.
func (s *Server) handlePluginLog(w http.ResponseWriter, r *http.Request) {
	b, code, err := readBody(w, r)
	if err != nil {
		reply(w, code, ambient.PodEventResponse{Error: err.Error()})
		return
	}
	l, err := ambient.DecodePluginLog(b)
	if err != nil {
		reply(w, http.StatusBadRequest, ambient.PodEventResponse{Error: err.Error()})
		return
	}
	log := s.cfg.Logger.With("component", "cni-plugin")
	for _, rec := range l.Records {
		var lv slog.Level
		_ = lv.UnmarshalText([]byte(rec.Level)) // DecodePluginLog checked it
		attrs := make([]slog.Attr, 0, len(rec.Attrs)/2)
		for i := 0; i+1 < len(rec.Attrs); i += 2 {
			attrs = append(attrs, slog.String(rec.Attrs[i], rec.Attrs[i+1]))
		}
		log.LogAttrs(r.Context(), lv, rec.Msg, attrs...)
	}
	reply(w, http.StatusOK, ambient.PodEventResponse{Verdict: ambient.VerdictOK})
}

func (s *Server) handleGC(w http.ResponseWriter, r *http.Request) {
	b, code, err := readBody(w, r)
	if err != nil {
		reply(w, code, ambient.PodEventResponse{Error: err.Error()})
		return
	}
	req, err := ambient.DecodeGCRequest(b)
	if err != nil {
		reply(w, http.StatusBadRequest, ambient.PodEventResponse{Error: err.Error()})
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), s.cfg.HandlerTimeout)
	defer cancel()
	start := time.Now()
	n := s.agent.GC(ctx, req.Network, req.ValidSandboxIDs)
	s.observe("GC", string(ambient.VerdictOK), time.Since(start))
	s.log.Info("gc", "valid", len(req.ValidSandboxIDs), "removed", n)
	reply(w, http.StatusOK, ambient.PodEventResponse{Verdict: ambient.VerdictOK})
}
