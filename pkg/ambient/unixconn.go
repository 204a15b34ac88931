package ambient

import (
	"context"
	"errors"
	"io"
	"os"
	"syscall"
	"time"
)

// unixConn is a client connection to a Unix socket on plain blocking
// system calls. The plugin makes one exchange per process: Go's network
// poller (its epoll set, and the threads that spin while the one goroutine
// waits for the agent) costs the plugin more CPU than the exchange itself.
// The context's deadline becomes the socket's send and receive timeouts;
// its cancellation shuts the socket down, which wakes a blocked call.
type unixConn struct {
	fd   int
	ctx  context.Context
	stop func() bool
}

// errTimeout is what a call that ran past the deadline returns.
var errTimeout = os.ErrDeadlineExceeded

func dialUnix(ctx context.Context, path string) (*unixConn, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	fd, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	c := &unixConn{fd: fd, ctx: ctx}
	if dl, ok := ctx.Deadline(); ok {
		left := time.Until(dl)
		if left <= 0 {
			_ = syscall.Close(fd)
			return nil, errTimeout
		}
		tv := syscall.NsecToTimeval(left.Nanoseconds())
		if tv.Sec == 0 && tv.Usec == 0 {
			tv.Usec = 1 // zero would mean no timeout
		}
		for _, opt := range []int{syscall.SO_SNDTIMEO, syscall.SO_RCVTIMEO} {
			if err := syscall.SetsockoptTimeval(fd, syscall.SOL_SOCKET, opt, &tv); err != nil {
				_ = syscall.Close(fd)
				return nil, os.NewSyscallError("setsockopt", err)
			}
		}
	}
	c.stop = context.AfterFunc(ctx, func() { _ = syscall.Shutdown(fd, syscall.SHUT_RDWR) })
	for {
		err = syscall.Connect(fd, &syscall.SockaddrUnix{Name: path})
		if err != syscall.EINTR {
			break
		}
	}
	if err != nil {
		c.Close()
		if errors.Is(err, syscall.EAGAIN) || errors.Is(err, syscall.EINPROGRESS) {
			return nil, errTimeout
		}
		return nil, c.ended(os.NewSyscallError("connect", err))
	}
	return c, nil
}

// ended names the context's end as the cause of err when the context is
// done: the socket was shut down for it.
func (c *unixConn) ended(err error) error {
	switch c.ctx.Err() {
	case nil:
		return err
	case context.DeadlineExceeded:
		return errTimeout
	default:
		return c.ctx.Err()
	}
}

// Read reads from the socket.
func (c *unixConn) Read(p []byte) (int, error) {
	for {
		n, err := syscall.Read(c.fd, p)
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			return 0, errTimeout
		case err != nil:
			return 0, c.ended(os.NewSyscallError("read", err))
		case n == 0 && len(p) > 0:
			return 0, c.ended(io.EOF)
		}
		return n, nil
	}
}

// Write writes all of p to the socket.
func (c *unixConn) Write(p []byte) (int, error) {
	done := 0
	for done < len(p) {
		n, err := syscall.Write(c.fd, p[done:])
		switch {
		case err == syscall.EINTR:
			continue
		case err == syscall.EAGAIN:
			return done, errTimeout
		case err != nil:
			return done, c.ended(os.NewSyscallError("write", err))
		}
		done += n
	}
	return done, nil
}

// Close releases the socket.
func (c *unixConn) Close() error {
	if c.stop != nil {
		c.stop()
	}
	return syscall.Close(c.fd)
}
