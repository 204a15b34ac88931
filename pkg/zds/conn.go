package zds

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

type connState int

const (
	stateHello    connState = iota // waiting for ztunnel's hello
	stateSnapshot                  // sending the snapshot; Adds queue behind it
	stateReady                     // snapshot acked
)

// maxPeerFDs sizes the control buffer so descriptors a hostile peer sends
// are received (and closed) rather than left to the kernel to truncate.
const maxPeerFDs = 16

// conn is one ztunnel connection. Two goroutines own it: readLoop turns
// datagrams into acks for the outstanding request, and run sends the
// snapshot and then the queued requests one at a time.
type conn struct {
	id  uint64
	s   *Server
	uc  *net.UnixConn
	log *slog.Logger

	state connState // guarded by s.mu

	mu       sync.Mutex
	queue    []*request
	closed   bool
	awaiting bool // a request (or the hello) is outstanding

	wake  chan struct{} // a request was queued
	inbox chan []byte   // the reply to the outstanding request
	done  chan struct{} // closed at teardown

	failOnce sync.Once
}

func newConn(s *Server, id uint64, uc *net.UnixConn) *conn {
	pid, uid := peerCred(uc)
	c := &conn{
		id:    id,
		s:     s,
		uc:    uc,
		log:   s.log.With("conn", id, "peer_pid", pid, "peer_uid", uid),
		wake:  make(chan struct{}, 1),
		inbox: make(chan []byte, 1),
		done:  make(chan struct{}),
		// ztunnel speaks first; its hello may arrive before run starts.
		awaiting: true,
	}
	c.log.Info("ztunnel connected")
	return c
}

// request is one Add or Del waiting in a connection's queue. Whoever
// finishes it (the worker or the teardown) closes its descriptor.
type request struct {
	ctx  context.Context // a request whose caller gave up is skipped
	op   string
	uid  string
	msg  []byte
	fd   int // -1: none
	done chan error
}

func newRequest(ctx context.Context, op, uid string, msg []byte, fd int) *request {
	return &request{ctx: ctx, op: op, uid: uid, msg: msg, fd: fd, done: make(chan error, 1)}
}

func (r *request) finish(err error) {
	if r.fd >= 0 {
		_ = unix.Close(r.fd)
		r.fd = -1
	}
	r.done <- err
}

// submit queues r; false means the connection is gone and r was not taken.
func (c *conn) submit(r *request) bool {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return false
	}
	c.queue = append(c.queue, r)
	c.mu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
	return true
}

func (c *conn) pop() *request {
	for {
		c.mu.Lock()
		if c.closed {
			c.mu.Unlock()
			return nil
		}
		if len(c.queue) > 0 {
			r := c.queue[0]
			c.queue[0] = nil
			c.queue = c.queue[1:]
			c.mu.Unlock()
			return r
		}
		c.mu.Unlock()
		select {
		case <-c.wake:
		case <-c.done:
			return nil
		}
	}
}

// fail tears the connection down once: it leaves the server's list, stops
// both goroutines and fails every queued request.
func (c *conn) fail(cause error) {
	c.failOnce.Do(func() {
		c.s.removeConn(c)
		c.mu.Lock()
		c.closed = true
		q := c.queue
		c.queue = nil
		c.mu.Unlock()
		close(c.done)
		_ = c.uc.Close()
		for _, r := range q {
			r.finish(fmt.Errorf("%w: %w", errConnLost, cause))
		}
		lvl := slog.LevelWarn
		if errors.Is(cause, io.EOF) || errors.Is(cause, ErrClosed) {
			lvl = slog.LevelInfo
		}
		c.log.Log(context.Background(), lvl, "ztunnel connection closed", "reason", cause)
	})
}

// readLoop reads every datagram the peer sends. Reading continuously is
// what detects a dead peer while idle (its socket closes with it), and what
// catches unsolicited messages such as a second ack.
func (c *conn) readLoop() {
	defer c.s.wg.Done()
	buf := make([]byte, MaxMessageSize+1)
	oob := make([]byte, unix.CmsgSpace(4*maxPeerFDs))
	for {
		n, oobn, flags, _, err := c.uc.ReadMsgUnix(buf, oob)
		if oobn > 0 {
			closeRights(oob[:oobn])
			c.fail(fmt.Errorf("%w: peer sent ancillary data", errProtocol))
			return
		}
		if err != nil {
			c.fail(fmt.Errorf("read: %w", err))
			return
		}
		if n == 0 { // SOCK_SEQPACKET end of stream; a real message is never empty
			c.fail(io.EOF)
			return
		}
		if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 || n > MaxMessageSize {
			c.fail(fmt.Errorf("%w: message larger than %d bytes", errProtocol, MaxMessageSize))
			return
		}
		c.mu.Lock()
		expected := c.awaiting
		c.awaiting = false
		c.mu.Unlock()
		if !expected {
			c.fail(fmt.Errorf("%w: unsolicited message (%d bytes) with no request outstanding", errProtocol, n))
			return
		}
		select {
		case c.inbox <- bytes.Clone(buf[:n]):
		case <-c.done:
			return
		}
	}
}

// closeRights closes any descriptors carried in a control message.
func closeRights(oob []byte) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return
	}
	for _, m := range msgs {
		if fds, err := unix.ParseUnixRights(&m); err == nil {
			for _, fd := range fds {
				_ = unix.Close(fd)
			}
		}
	}
}

// run is the connection's worker: hello, snapshot, then the queue.
func (c *conn) run() {
	defer c.s.wg.Done()
	if err := c.hello(); err != nil {
		c.fail(err)
		return
	}
	if err := c.snapshot(); err != nil {
		c.fail(err)
		return
	}
	for {
		r := c.pop()
		if r == nil {
			return
		}
		if r.op == opBarrier {
			r.finish(nil) // everything queued before it is done
			continue
		}
		if err := r.ctx.Err(); err != nil {
			r.finish(fmt.Errorf("caller gave up before send: %w", err))
			continue
		}
		err := c.roundTrip(r.op, r.uid, r.msg, r.fd)
		if err != nil {
			c.log.Info("zds request failed", "op", r.op, "uid", r.uid, "err", err)
		}
		lost := errors.Is(err, errConnLost)
		if lost {
			// Leave the server's list before the caller hears of it, so
			// its retry cannot pick this connection again.
			c.fail(err)
		}
		r.finish(err)
		if lost {
			return
		}
	}
}

func (c *conn) hello() error {
	t := time.NewTimer(c.s.cfg.HelloTimeout)
	defer t.Stop()
	select {
	case b := <-c.inbox:
		h, err := decodeHello(b)
		if err != nil {
			return err
		}
		c.log.Info("ztunnel hello", "version", h.GetVersion().String())
		return nil
	case <-t.C:
		return fmt.Errorf("no hello within %s", c.s.cfg.HelloTimeout)
	case <-c.done:
		return errConnLost
	}
}

func (c *conn) snapshot() error {
	// Adds may target this connection from now on; they queue behind the
	// snapshot, so a pod enrolled while it is sent still reaches ztunnel.
	c.s.setState(c, stateSnapshot)
	start := time.Now()
	var ws []Workload
	if c.s.cfg.Snapshot != nil {
		ws = c.s.cfg.Snapshot()
	}
	adds, keeps := 0, 0
	for _, w := range ws {
		if w.UID == "" {
			continue
		}
		op, fd := "keep", -1
		req := keepRequest(w.UID)
		if w.Netns != nil {
			var err error
			if fd, err = dupFile(w.Netns); err != nil {
				// Closed by its owner meanwhile: the pod is being removed.
				c.log.Info("snapshot: netns file gone, leaving pod out", "uid", w.UID, "err", err)
				continue
			}
			op, req = "add", addRequest(w.UID, w.Info)
		}
		msg, err := encodeRequest(req)
		if err != nil {
			c.log.Error("snapshot: cannot encode workload", "uid", w.UID, "err", err)
			if fd >= 0 {
				_ = unix.Close(fd)
			}
			continue
		}
		err = c.roundTrip(op, w.UID, msg, fd)
		if fd >= 0 {
			_ = unix.Close(fd)
		}
		var ackErr *AckError
		switch {
		case errors.As(err, &ackErr):
			c.log.Warn("snapshot: ztunnel refused workload", "uid", w.UID, "op", op, "err", ackErr.Msg)
		case err != nil:
			return err
		case op == "add":
			adds++
			if c.s.cfg.SnapshotAcked != nil {
				c.s.cfg.SnapshotAcked(w.UID, w.Netns)
			}
		default:
			keeps++
		}
	}
	msg, err := encodeRequest(snapshotSentRequest())
	if err != nil {
		return err
	}
	if err := c.roundTrip("snapshot", "", msg, -1); err != nil {
		return fmt.Errorf("snapshot sent: %w", err)
	}
	c.s.setState(c, stateReady)
	c.log.Info("snapshot acked", "adds", adds, "keeps", keeps, "took", time.Since(start))
	return nil
}

// roundTrip sends one datagram and waits for its ack. Errors wrapping
// errConnLost mean the connection must go; *AckError leaves it usable.
func (c *conn) roundTrip(op, uid string, msg []byte, fd int) error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return errConnLost
	}
	c.awaiting = true
	c.mu.Unlock()

	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	if err := c.uc.SetWriteDeadline(time.Now().Add(c.s.cfg.WriteTimeout)); err != nil {
		return fmt.Errorf("%w: set write deadline: %w", errConnLost, err)
	}
	n, oobn, err := c.uc.WriteMsgUnix(msg, oob, nil)
	if err != nil {
		return fmt.Errorf("%w: write %s: %w", errConnLost, op, err)
	}
	if n != len(msg) || oobn != len(oob) {
		return fmt.Errorf("%w: short write of %s", errConnLost, op)
	}
	t := time.NewTimer(c.s.cfg.AckTimeout)
	defer t.Stop()
	select {
	case b := <-c.inbox:
		ack, err := decodeAck(b)
		if err != nil {
			return fmt.Errorf("%w: %w", errConnLost, err)
		}
		if ack.GetError() != "" {
			return &AckError{Op: op, UID: uid, Msg: ack.GetError()}
		}
		return nil
	case <-t.C:
		return fmt.Errorf("%w: no ack for %s %s within %s", errConnLost, op, uid, c.s.cfg.AckTimeout)
	case <-c.done:
		return errConnLost
	}
}
