package ambient

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// listen serves each connection with serve on a Unix socket in a temp dir.
func listen(t *testing.T, serve func(net.Conn)) string {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "s.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			serve(c)
		}
	}()
	t.Cleanup(func() { _ = ln.Close(); <-done })
	return sock
}

func TestUnixConnRoundTrip(t *testing.T) {
	sock := listen(t, func(c net.Conn) {
		defer c.Close()
		b := make([]byte, 4)
		if _, err := io.ReadFull(c, b); err == nil {
			_, _ = c.Write(append(b, '!'))
		}
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	c, err := dialUnix(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	got, err := io.ReadAll(c)
	if err != nil || string(got) != "ping!" {
		t.Fatalf("read %q, %v", got, err)
	}
}

func TestUnixConnNoListener(t *testing.T) {
	_, err := dialUnix(context.Background(), filepath.Join(t.TempDir(), "none.sock"))
	if !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("dial of a missing socket: %v, want ENOENT", err)
	}
	_, err = (&Client{Socket: filepath.Join(t.TempDir(), "none.sock")}).PodEvent(context.Background(), &PodEvent{})
	var u *UnreachableError
	if !errors.As(err, &u) {
		t.Fatalf("client on a missing socket: %v, want UnreachableError", err)
	}
}

// A hung peer: the deadline ends the read as a timeout; cancellation
// without a deadline ends it as cancelled.
func TestUnixConnHungPeer(t *testing.T) {
	hold := make(chan struct{})
	defer close(hold)
	sock := listen(t, func(c net.Conn) {
		go func() { <-hold; _ = c.Close() }()
	})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	c, err := dialUnix(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Read(make([]byte, 1))
	_ = c.Close()
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past the deadline: %v, want a timeout", err)
	}

	ctx, cancel = context.WithCancel(context.Background())
	c, err = dialUnix(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	res := make(chan error, 1)
	go func() { _, err := c.Read(make([]byte, 1)); res <- err }()
	cancel()
	if err := <-res; !errors.Is(err, context.Canceled) {
		t.Fatalf("read after cancel: %v, want context.Canceled", err)
	}
}
