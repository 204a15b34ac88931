// Package zds is the node agent's side of ZDS, the protocol through which
// the agent hands pod network namespaces to ztunnel over a SOCK_SEQPACKET
// Unix socket.
//
// The agent listens; each ztunnel connects, says hello, and receives a
// snapshot of every enrolled pod (Add with the netns fd, or Keep) followed by
// SnapshotSent. After that the server sends Add and Del one at a time per
// connection, each matched to its own Ack. Adds go to the newest connection,
// Dels to every connection, so a rolling ztunnel upgrade works.
//
// Liveness: every connection is read continuously, so a ztunnel that dies
// (its socket closes with it) or sends anything unasked is dropped at once,
// even while idle; a ztunnel that hangs is dropped at the first ack it
// misses (AckTimeout), and every write has a deadline (WriteTimeout). ZDS
// has no ping message, so an idle hung peer is found on its next request.
package zds

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"golang.org/x/time/rate"

	"github.com/ambient-cni/ambient-cni/pkg/unixsock"
)

// Defaults for the zero values of Config.
const (
	DefaultAckTimeout     = 5 * time.Second
	DefaultWriteTimeout   = 5 * time.Second
	DefaultHelloTimeout   = 5 * time.Second
	DefaultMaxConnections = 8
	DefaultAcceptRate     = 10.0
	DefaultAcceptBurst    = 5
)

var (
	// ErrNoZtunnel means no ztunnel was connected (with its hello done)
	// before the caller's context ended. Callers treat it as retryable.
	ErrNoZtunnel = errors.New("no ztunnel connected")
	// ErrClosed means the server has stopped serving.
	ErrClosed = errors.New("zds server closed")
	// errConnLost marks a request that died with its connection; Add
	// retries it on another connection, Del ignores it (the next snapshot
	// of that ztunnel will not name the pod).
	errConnLost = errors.New("ztunnel connection lost")
)

// AckError is ztunnel's refusal of one request (an Ack with a non-empty
// error). The connection stays up.
type AckError struct {
	Op  string // "add", "keep", "del" or "snapshot"
	UID string
	Msg string // ztunnel's error text
}

// Error describes the refusal.
func (e *AckError) Error() string {
	return fmt.Sprintf("ztunnel refused %s %s: %s", e.Op, e.UID, e.Msg)
}

// WorkloadInfo names a pod for ztunnel.
type WorkloadInfo struct {
	Name, Namespace, ServiceAccount string
}

// Workload is one enrolled pod.
type Workload struct {
	UID  string
	Info WorkloadInfo
	// Netns is the pod's network namespace. The caller owns the file: the
	// server duplicates the descriptor while holding a reference to it, so
	// the owner may close it at any time (a file closed before the server
	// got to it is left out of a snapshot). Nil makes a snapshot send Keep.
	Netns *os.File
}

// Config configures a Server. Zero values take the defaults.
type Config struct {
	// SocketPath is where to listen (required; install-cni passes
	// ambient.DefaultZDSSocket unless told otherwise).
	SocketPath string
	// Snapshot returns the currently enrolled pods, including those whose
	// Add is still in flight. It runs on a connection's own goroutine right
	// after the hello, so it must be cheap and never wait on enroll work.
	Snapshot func() []Workload
	// SnapshotAcked, when set, is told about every Add of a snapshot that
	// ztunnel acked, with the workload's uid and the netns file it was
	// sent with. It runs on the connection's goroutine: keep it quick.
	SnapshotAcked func(uid string, netns *os.File)
	// AckTimeout bounds the wait for each Ack; a missed ack tears the
	// connection down so no late ack is ever matched to the next request.
	AckTimeout time.Duration
	// WriteTimeout is the deadline for each datagram write.
	WriteTimeout time.Duration
	// HelloTimeout bounds the wait for ztunnel's hello after accept.
	HelloTimeout time.Duration
	// MaxConnections caps concurrent connections; more are closed at once.
	MaxConnections int
	// AcceptRate (per second) and AcceptBurst bound how fast connections
	// are accepted; the rest wait in the listen backlog.
	AcceptRate  float64
	AcceptBurst int
	// Logger receives structured logs (default: discarded).
	Logger *slog.Logger
}

func (c Config) withDefaults() Config {
	if c.AckTimeout <= 0 {
		c.AckTimeout = DefaultAckTimeout
	}
	if c.WriteTimeout <= 0 {
		c.WriteTimeout = DefaultWriteTimeout
	}
	if c.HelloTimeout <= 0 {
		c.HelloTimeout = DefaultHelloTimeout
	}
	if c.MaxConnections <= 0 {
		c.MaxConnections = DefaultMaxConnections
	}
	if c.AcceptRate <= 0 {
		c.AcceptRate = DefaultAcceptRate
	}
	if c.AcceptBurst <= 0 {
		c.AcceptBurst = DefaultAcceptBurst
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Server is the ZDS listener and its connections.
type Server struct {
	cfg Config
	log *slog.Logger

	mu      sync.Mutex
	ln      *unixsock.Listener // closing it removes the socket file while it is ours
	conns   []*conn
	changed chan struct{} // closed and replaced whenever conns or a state changes
	serving bool
	closed  bool
	cancel  context.CancelFunc
	nextID  uint64

	wg sync.WaitGroup // connection goroutines
}

// NewServer returns a server for cfg; call Listen, then Serve.
func NewServer(cfg Config) *Server {
	cfg = cfg.withDefaults()
	return &Server{cfg: cfg, log: cfg.Logger, changed: make(chan struct{})}
}

// SocketPath is the path the server listens on.
func (s *Server) SocketPath() string { return s.cfg.SocketPath }

// Listen creates the socket directory if needed and binds a SOCK_SEQPACKET
// listener that atomically replaces a stale socket file. A non-socket file
// at the path is an error rather than something to delete.
func (s *Server) Listen() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return ErrClosed
	}
	if s.ln != nil {
		return nil
	}
	if s.cfg.SocketPath == "" {
		// No default: it would be the real node's socket.
		return errors.New("zds: Config.SocketPath is required")
	}
	// Bound under a private name and renamed into place: ztunnel never
	// sees the path missing, and shutdown never unlinks a newer agent's
	// socket.
	ln, err := unixsock.Listen(unixsock.Config{Path: s.cfg.SocketPath, Net: "unixpacket"})
	if err != nil {
		return fmt.Errorf("zds socket: %w", err)
	}
	s.ln = ln
	s.log.Info("zds listening", "path", s.cfg.SocketPath)
	return nil
}

// Listening reports whether Listen succeeded and the server is not closed.
func (s *Server) Listening() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.ln != nil && !s.closed
}

// Serve accepts ztunnel connections until ctx ends (or Close is called),
// then closes every connection, waits for their goroutines and removes the
// socket file if it is still the one it created. It calls Listen if needed.
func (s *Server) Serve(ctx context.Context) error {
	if err := s.Listen(); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	s.mu.Lock()
	if s.serving || s.closed {
		s.mu.Unlock()
		return errors.New("zds server already serving or closed")
	}
	s.serving, s.cancel = true, cancel
	ln := s.ln
	s.mu.Unlock()

	stopped := make(chan struct{})
	go func() { // owner: Serve, which waits for it below
		defer close(stopped)
		<-ctx.Done()
		_ = ln.Close()
	}()

	lim := rate.NewLimiter(rate.Limit(s.cfg.AcceptRate), s.cfg.AcceptBurst)
	backoff := 10 * time.Millisecond
	for {
		if err := lim.Wait(ctx); err != nil {
			break
		}
		uc, err := ln.AcceptUnix()
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				break
			}
			// EMFILE and friends: wait rather than spin.
			s.log.Warn("zds accept failed", "err", err, "retry_in", backoff)
			if sleepCtx(ctx, backoff) != nil {
				break
			}
			backoff = min(backoff*2, time.Second)
			continue
		}
		backoff = 10 * time.Millisecond
		s.startConn(uc)
	}
	cancel()
	<-stopped

	s.mu.Lock()
	s.closed = true
	conns := append([]*conn(nil), s.conns...)
	s.notifyLocked()
	s.mu.Unlock()
	for _, c := range conns {
		c.fail(ErrClosed)
	}
	s.wg.Wait()
	s.log.Info("zds server stopped")
	return nil
}

// Close stops a serving server (Serve returns) or releases the listener of
// one that never served.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.serving {
		s.cancel()
		return nil
	}
	s.closed = true
	s.notifyLocked()
	if s.ln != nil {
		err := s.ln.Close()
		s.ln = nil
		return err
	}
	return nil
}

// Connections is the number of live ztunnel connections.
func (s *Server) Connections() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// ReadyConnections is the number of connections whose snapshot ztunnel
// has acknowledged.
func (s *Server) ReadyConnections() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.conns {
		if c.state == stateReady {
			n++
		}
	}
	return n
}

// WaitReady blocks until at least one connection has its snapshot acked or
// ctx ends.
func (s *Server) WaitReady(ctx context.Context) error {
	for {
		s.mu.Lock()
		if s.closed {
			s.mu.Unlock()
			return ErrClosed
		}
		for _, c := range s.conns {
			if c.state == stateReady {
				s.mu.Unlock()
				return nil
			}
		}
		ch := s.changed
		s.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("wait for ztunnel snapshot: %w: %w", ErrNoZtunnel, ctx.Err())
		}
	}
}

// opBarrier is a request that sends nothing: the connection's worker
// finishes it when it reaches it, so every request queued before it has
// been answered (or failed).
const opBarrier = "barrier"

func (s *Server) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

func (s *Server) setState(c *conn, st connState) {
	s.mu.Lock()
	defer s.mu.Unlock()
	c.state = st
	s.notifyLocked()
}

func (s *Server) removeConn(c *conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, x := range s.conns {
		if x == c {
			s.conns = append(s.conns[:i], s.conns[i+1:]...)
			break
		}
	}
	s.notifyLocked()
}

func (s *Server) startConn(uc *net.UnixConn) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		_ = uc.Close()
		return
	}
	if len(s.conns) >= s.cfg.MaxConnections {
		s.mu.Unlock()
		s.log.Warn("zds connection refused: too many connections", "max", s.cfg.MaxConnections)
		_ = uc.Close()
		return
	}
	s.nextID++
	c := newConn(s, s.nextID, uc)
	s.conns = append(s.conns, c)
	s.wg.Add(2)
	s.mu.Unlock()
	go c.readLoop() // owner: c; ends when c.uc is closed
	go c.run()      // owner: c; ends at teardown
}

// dupFile duplicates f's descriptor while holding a reference to f, so a
// concurrent Close by its owner can neither race nor let the number be
// reused for another file.
func dupFile(f *os.File) (int, error) {
	rc, err := f.SyscallConn()
	if err != nil {
		return -1, err
	}
	nfd, derr := -1, error(nil)
	if err := rc.Control(func(fd uintptr) {
		nfd, derr = unix.FcntlInt(fd, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return -1, err
	}
	if derr != nil {
		return -1, derr
	}
	return nfd, nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// peerCred reads the peer's pid and uid for logs; -1 when unknown.
func peerCred(uc *net.UnixConn) (pid, uid int) {
	cred, err := unixsock.PeerCred(uc)
	if err != nil || cred == nil {
		return -1, -1
	}
	return int(cred.Pid), int(cred.Uid)
}
