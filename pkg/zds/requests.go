package zds

import (
	"context"
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// The agent's requests to ztunnel: a pod's Add and Del, to the connections
// that should see them, and the drain at shutdown.

// Add hands a pod to ztunnel and waits for the ack of the newest
// connection whose snapshot is done. Newer connections still sending their
// snapshot also get the Add, queued behind the snapshot and not awaited, so
// a ztunnel that connects during an enrollment learns the pod even if its
// snapshot was taken too early; callers must record the pod in the state
// Snapshot reads before calling Add. With only snapshotting connections Add
// awaits the newest of them. When the awaited connection dies first, Add
// retries on the next. With no ztunnel it waits until ctx ends and returns
// an error wrapping ErrNoZtunnel; ctx should carry a deadline. A refusal by
// ztunnel is an *AckError. The caller keeps ownership of w.Netns.
func (s *Server) Add(ctx context.Context, w Workload) error {
	if w.UID == "" {
		return errors.New("zds add: empty uid")
	}
	if w.Netns == nil {
		return fmt.Errorf("zds add %s: no netns file", w.UID)
	}
	msg, err := encodeRequest(addRequest(w.UID, w.Info))
	if err != nil {
		return fmt.Errorf("zds add %s: %w", w.UID, err)
	}
	for {
		target, extra, wait, err := s.addTargets()
		if err != nil {
			return fmt.Errorf("zds add %s: %w", w.UID, err)
		}
		if target == nil {
			select {
			case <-wait:
				continue
			case <-ctx.Done():
				return fmt.Errorf("zds add %s: %w: %w", w.UID, ErrNoZtunnel, ctx.Err())
			}
		}
		for _, c := range extra {
			// Not awaited: it outlives this call, so it must not be
			// skipped when the caller's context ends.
			if _, err := s.submitAdd(context.WithoutCancel(ctx), c, w, msg); err != nil {
				return err
			}
		}
		req, err := s.submitAdd(ctx, target, w, msg)
		if err != nil {
			return err
		}
		if req == nil {
			continue // connection went away before taking it
		}
		select {
		case err := <-req.done:
			if errors.Is(err, errConnLost) {
				s.log.Info("zds add: connection lost, retrying on another", "uid", w.UID, "conn", target.id, "err", err)
				continue
			}
			if err != nil {
				return fmt.Errorf("zds add %s: %w", w.UID, err)
			}
			return nil
		case <-ctx.Done():
			return fmt.Errorf("zds add %s: waiting for ztunnel ack: %w", w.UID, ctx.Err())
		}
	}
}

// submitAdd queues an Add with its own duplicate of the netns descriptor;
// a nil request means c was already gone.
func (s *Server) submitAdd(ctx context.Context, c *conn, w Workload, msg []byte) (*request, error) {
	fd, err := dupFile(w.Netns)
	if err != nil {
		return nil, fmt.Errorf("zds add %s: duplicate netns fd: %w", w.UID, err)
	}
	req := newRequest(ctx, "add", w.UID, msg, fd)
	if !c.submit(req) {
		_ = unix.Close(fd)
		return nil, nil
	}
	return req, nil
}

// Del removes a pod from every connected ztunnel (past its hello) and waits
// for their acks, until ctx ends; the Dels are sent either way.
// Connections that die meanwhile are ignored: their
// ztunnel's next snapshot will not name the pod, provided the caller removed
// it from the state Snapshot reads before calling Del. With no connection
// it returns nil. A refusal by ztunnel is an *AckError.
func (s *Server) Del(ctx context.Context, uid string) error {
	msg, conns, err := s.prepareDel(uid)
	if err != nil {
		return err
	}
	var reqs []*request
	for _, c := range conns {
		// Sent even if the caller stops waiting first (queued behind
		// slow acks): the pod is already out of the state, and a ztunnel
		// whose connection lives on would otherwise serve it until its
		// next snapshot, which may never come.
		r := newRequest(context.WithoutCancel(ctx), "del", uid, msg, -1)
		if c.submit(r) {
			reqs = append(reqs, r)
		}
	}
	var errs []error
	for _, r := range reqs {
		select {
		case err := <-r.done:
			if err != nil && !errors.Is(err, errConnLost) {
				errs = append(errs, err)
			}
		case <-ctx.Done():
			return fmt.Errorf("zds del %s: waiting for ztunnel acks: %w", uid, ctx.Err())
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("zds del %s: %w", uid, err)
	}
	return nil
}

// DelNoWait queues a Del on every connected ztunnel (past its hello),
// behind whatever each connection already has queued and ahead of any
// later Add, and returns without waiting for the acks; a refusal is only
// logged. The caller must have removed the pod from the state Snapshot
// reads, as for Del. With no connection it does nothing.
func (s *Server) DelNoWait(uid string) error {
	msg, conns, err := s.prepareDel(uid)
	if err != nil {
		return err
	}
	for _, c := range conns {
		// Nobody awaits it: the request's done channel has room for its
		// one result, and the connection logs a failure.
		c.submit(newRequest(context.Background(), "del", uid, msg, -1))
	}
	return nil
}

// Drain waits until every request already queued on every connection
// (such as the Dels DelNoWait queued) is acked or failed, or ctx ends: an
// uninstall tells ztunnel about every released pod before the server
// closes, without hanging on a ztunnel that stopped answering.
func (s *Server) Drain(ctx context.Context) error {
	s.mu.Lock()
	conns := s.liveConns()
	s.mu.Unlock()
	var reqs []*request
	for _, c := range conns {
		r := newRequest(ctx, opBarrier, "", nil, -1)
		if c.submit(r) {
			reqs = append(reqs, r)
		}
	}
	for _, r := range reqs {
		select {
		case <-r.done:
		case <-ctx.Done():
			return fmt.Errorf("zds drain: waiting for ztunnel acks: %w", ctx.Err())
		}
	}
	return nil
}

// prepareDel encodes a Del for uid and returns the connections (past their
// hello) it goes to.
func (s *Server) prepareDel(uid string) ([]byte, []*conn, error) {
	if uid == "" {
		return nil, nil, errors.New("zds del: empty uid")
	}
	msg, err := encodeRequest(delRequest(uid))
	if err != nil {
		return nil, nil, fmt.Errorf("zds del %s: %w", uid, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, nil, fmt.Errorf("zds del %s: %w", uid, ErrClosed)
	}
	return msg, s.liveConns(), nil
}

// addTargets picks the connection whose ack an Add awaits (the newest
// ready one, else the newest still in its snapshot) and the newer ones in
// their snapshot that also get it. With no target it returns a channel that
// is closed when that may have changed.
func (s *Server) addTargets() (target *conn, extra []*conn, wait <-chan struct{}, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, nil, nil, ErrClosed
	}
	for i := len(s.conns) - 1; i >= 0; i-- {
		c := s.conns[i]
		if c.state == stateReady {
			return c, extra, nil, nil
		}
		if c.state == stateSnapshot {
			extra = append(extra, c)
		}
	}
	if len(extra) > 0 {
		return extra[0], extra[1:], nil, nil
	}
	return nil, nil, s.changed, nil
}

// liveConns lists the connections past their hello: a connection still
// waiting for one takes its snapshot later, which no longer names a pod
// removed from the state before Del.
func (s *Server) liveConns() []*conn {
	var out []*conn
	for _, c := range s.conns {
		if c.state != stateHello {
			out = append(out, c)
		}
	}
	return out
}
