package ztunnel

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"syscall"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// inNetns runs fn on a locked OS thread that has entered the network
// namespace nsfd, then returns the thread to its original namespace. Sockets
// created inside fn stay in the pod's namespace for their whole life. If
// the thread cannot go back it stays locked, so Go discards it.
func inNetns(nsfd int, fn func() error) error {
	errc := make(chan error, 1)
	go func() { // owner: inNetns, which waits for errc
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := unix.Setns(nsfd, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter pod netns: %w", err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(orig), unix.CLONE_NEWNET); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("return to original netns: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// netnsID identifies a network namespace by its nsfs device and inode and
// checks that fd really is one.
func netnsID(fd int) (NetnsID, error) {
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err != nil {
		return NetnsID{}, fmt.Errorf("fstatfs: %w", err)
	}
	if sfs.Type != unix.NSFS_MAGIC {
		return NetnsID{}, errors.New("fd is not a namespace (not nsfs)")
	}
	t, err := unix.IoctlRetInt(fd, unix.NS_GET_NSTYPE)
	if err != nil {
		return NetnsID{}, fmt.Errorf("namespace type: %w", err)
	}
	if t != unix.CLONE_NEWNET {
		return NetnsID{}, errors.New("fd is a namespace but not a network namespace")
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return NetnsID{}, fmt.Errorf("fstat: %w", err)
	}
	return NetnsID{Dev: st.Dev, Ino: st.Ino}, nil
}

// podAddrs lists the global unicast addresses inside a network namespace.
func podAddrs(nsfd int) ([]netip.Addr, error) {
	h, err := netlink.NewHandleAt(netns.NsHandle(nsfd))
	if err != nil {
		return nil, fmt.Errorf("netlink in pod netns: %w", err)
	}
	defer h.Close()
	addrs, err := h.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("list pod addresses: %w", err)
	}
	var out []netip.Addr
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok {
			continue
		}
		ip = ip.Unmap()
		if ip.IsGlobalUnicast() {
			out = append(out, ip)
		}
	}
	return out, nil
}

// reusePort lets an old and a new stand-in (or ztunnel) hold the same
// in-pod ports during a rolling upgrade.
func reusePort(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEPORT, 1)
	}); err != nil {
		return err
	}
	return serr
}

// markSocket sets ztunnel's mark so the in-pod rules let the socket's
// traffic pass instead of redirecting it back to us.
func markSocket(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(ambient.ZtunnelMark))
	}); err != nil {
		return err
	}
	return serr
}

// listenIn opens a TCP listener inside a pod's netns.
func listenIn(nsfd int, network string, port int) (net.Listener, error) {
	var ln net.Listener
	err := inNetns(nsfd, func() error {
		lc := net.ListenConfig{Control: reusePort}
		addr := fmt.Sprintf("0.0.0.0:%d", port)
		if network == "tcp6" {
			addr = fmt.Sprintf("[::]:%d", port)
		}
		var err error
		ln, err = lc.Listen(context.Background(), network, addr)
		return err
	})
	return ln, err
}

// dialFrom connects to target from inside a pod's netns with ztunnel's mark.
func dialFrom(ctx context.Context, nsfd int, target netip.AddrPort) (net.Conn, error) {
	var c net.Conn
	err := inNetns(nsfd, func() error {
		d := net.Dialer{Control: markSocket}
		var err error
		c, err = d.DialContext(ctx, "tcp", target.String())
		return err
	})
	return c, err
}
