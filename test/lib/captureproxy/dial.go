package captureproxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// DialOptions shape the client socket.
type DialOptions struct {
	// Source binds the socket to this address (port chosen by the kernel).
	Source netip.Addr
	// Mark sets SO_MARK, as ztunnel does on its own sockets.
	Mark uint32
	// Transparent sets IP_TRANSPARENT / IPV6_TRANSPARENT so Source may be
	// an address the namespace does not own, as ztunnel does when it
	// connects to an application with the client's address.
	Transparent bool
	// Timeout bounds the whole exchange; default 5s.
	Timeout time.Duration
}

func (o DialOptions) dialer() *net.Dialer {
	d := &net.Dialer{}
	if o.Source.IsValid() {
		d.LocalAddr = &net.TCPAddr{IP: o.Source.AsSlice()}
	}
	if o.Mark != 0 || o.Transparent {
		d.Control = func(network, _ string, c syscall.RawConn) error {
			var serr error
			if err := c.Control(func(fd uintptr) {
				if o.Mark != 0 {
					serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, int(o.Mark))
				}
				if serr == nil && o.Transparent {
					if network == "tcp6" || network == "udp6" {
						serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
					} else {
						serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
					}
				}
			}); err != nil {
				return err
			}
			return serr
		}
	}
	return d
}

func (o DialOptions) timeout() time.Duration {
	if o.Timeout > 0 {
		return o.Timeout
	}
	return 5 * time.Second
}

// inNetns runs f inside the namespace at path ("" = current). Sockets
// created there keep belonging to that namespace afterwards.
func inNetns(path string, f func() error) error {
	if path == "" {
		return f()
	}
	return ns.WithNetNSPath(path, func(ns.NetNS) error { return f() })
}

// Dial connects over TCP from inside netnsPath to dst and returns the
// banner of the capture proxy listener that answered: which port got the
// connection and what original destination it saw.
func Dial(ctx context.Context, netnsPath string, dst netip.AddrPort, opt DialOptions) (Record, error) {
	ctx, cancel := context.WithTimeout(ctx, opt.timeout())
	defer cancel()
	var c net.Conn
	err := inNetns(netnsPath, func() error {
		var err error
		c, err = opt.dialer().DialContext(ctx, "tcp", dst.String())
		return err
	})
	if err != nil {
		return Record{}, fmt.Errorf("dial %s from netns %q: %w", dst, netnsPath, err)
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	_ = c.SetDeadline(dl)
	line, err := bufio.NewReaderSize(c, maxBanner).ReadSlice('\n')
	if err != nil {
		if errors.Is(err, bufio.ErrBufferFull) {
			return Record{}, fmt.Errorf("read banner from %s: longer than %d bytes", dst, maxBanner)
		}
		return Record{}, fmt.Errorf("read banner from %s: %w", dst, err)
	}
	return ParseBanner(string(line))
}

// ExchangeUDP sends payload in one datagram from inside netnsPath to dst
// and returns the banner of the listener that answered.
func ExchangeUDP(ctx context.Context, netnsPath string, dst netip.AddrPort, payload []byte, opt DialOptions) (Record, error) {
	ctx, cancel := context.WithTimeout(ctx, opt.timeout())
	defer cancel()
	d := opt.dialer()
	if opt.Source.IsValid() {
		d.LocalAddr = &net.UDPAddr{IP: opt.Source.AsSlice()}
	}
	var c net.Conn
	err := inNetns(netnsPath, func() error {
		var err error
		c, err = d.DialContext(ctx, "udp", dst.String())
		return err
	})
	if err != nil {
		return Record{}, fmt.Errorf("dial udp %s from netns %q: %w", dst, netnsPath, err)
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	_ = c.SetDeadline(dl)
	if _, err := c.Write(payload); err != nil {
		return Record{}, fmt.Errorf("send to %s: %w", dst, err)
	}
	buf := make([]byte, maxBanner+1)
	n, err := c.Read(buf)
	if err != nil {
		return Record{}, fmt.Errorf("read reply from %s: %w", dst, err)
	}
	return ParseBanner(string(buf[:n]))
}
