package netns

import (
	"errors"
	"fmt"
	"io"
	"runtime"

	"golang.org/x/sys/unix"
)

// This file is the only place in the project's production code that moves a
// thread into another network namespace. A thread left in the wrong
// namespace runs every goroutine the runtime schedules on it there, so the
// rules are kept in one place: the thread is locked for the whole switch,
// the original namespace is remembered before leaving it, and a thread that
// cannot return is never unlocked, so the runtime discards it (or, for the
// process's main thread, parks it) with the goroutine that owns it.

// Do runs fn inside the network namespace at path, on an OS thread locked
// to a goroutine of its own that Do waits for; sockets fn opens stay in
// that namespace and processes it starts inherit it. An empty path runs fn
// directly, in the caller's namespace. fn must not start goroutines that
// expect to run in the namespace: only its own thread is there. fn's error
// is returned as it is; failing to enter or to return names the path.
func Do(path string, fn func() error) error {
	if path == "" {
		return fn()
	}
	// O_NONBLOCK: a FIFO at path must fail setns, not block the open.
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return fmt.Errorf("open netns %s: %w", path, err)
	}
	defer unix.Close(fd)
	return doFD(fd, path, fn)
}

// Socket returns the socket dial opens inside the network namespace at path
// ("" = the caller's), dialled on a thread Do moved there. A socket belongs
// to the namespace it was created in for its whole life, so the caller uses
// it from any thread afterwards without entering anything: this is how code
// outside this package talks netlink inside a pod's namespace, instead of
// passing the namespace to a library that would switch a thread itself.
// dial must only open the socket. If the thread cannot return, the socket
// is closed and the error returned.
func Socket[S io.Closer](path string, dial func() (S, error)) (S, error) {
	var s S
	opened := false
	err := Do(path, func() error {
		var err error
		s, err = dial()
		opened = err == nil
		return err
	})
	if err != nil {
		if opened {
			_ = s.Close()
		}
		var zero S
		return zero, err
	}
	return s, nil
}

// DoInNew runs fn inside a new network namespace of its own, which is gone
// once fn returns (unless fn pinned it): for probing what the kernel
// accepts without touching any real namespace.
func DoInNew(fn func() error) error {
	return onOwnThread(unshareNet, fn)
}

// unshareNet moves the calling thread into a new network namespace.
func unshareNet() error {
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		return fmt.Errorf("unshare network namespace: %w", err)
	}
	return nil
}

// doFD is Do for an open namespace descriptor, which it does not close;
// name names it in errors.
func doFD(fd int, name string, fn func() error) error {
	return onOwnThread(func() error {
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("enter netns %s: setns: %w", name, err)
		}
		return nil
	}, fn)
}

// onOwnThread runs inThread on a new goroutine and waits for it: if the
// thread cannot return to its namespace, only that goroutine, which ends
// at once, ever ran on it.
func onOwnThread(enter, fn func() error) error {
	errc := make(chan error, 1)
	go func() { errc <- inThread(enter, fn) }() // owner: onOwnThread, which waits for it
	return <-errc
}

// inThread locks the calling goroutine to its thread, remembers the
// thread's network namespace, enters another with enter, runs fn and
// returns to the remembered namespace. The thread is unlocked only once it
// is back; if returning fails it stays locked, so the runtime ends it with
// the goroutine instead of scheduling others on it. It runs on the caller's
// goroutine (onOwnThread gives it one of its own); tests call it on the main
// thread, which the runtime cannot end.
func inThread(enter, fn func() error) error {
	runtime.LockOSThread()
	orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("open this thread's network namespace: %w", err)
	}
	defer unix.Close(orig)
	if err := enter(); err != nil {
		// setns and unshare change nothing when they fail.
		runtime.UnlockOSThread()
		return err
	}
	fnErr := fn()
	if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
		// Stay locked: the thread is discarded (or, the main thread,
		// parked) instead of running other goroutines in the wrong place.
		return errors.Join(fnErr, fmt.Errorf("return to the original network namespace: %w", err))
	}
	runtime.UnlockOSThread()
	return fnErr
}
