// Package captureproxy is a tiny stand-in for ztunnel's capture listeners,
// for the data-plane tests of pkg/iptables and test/cni and for the
// ztunnel stand-in: it listens inside a network namespace on the ports it is given
// (typically 15001, 15006, 15008, 15053 and an application port), and for
// every TCP connection or UDP datagram records which listener got it, the
// original destination the kernel's NAT saw (SO_ORIGINAL_DST or
// IP6T_SO_ORIGINAL_DST) and the peer. It answers each one with a one-line
// banner so the client side can tell where it landed too (see Dial).
package captureproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// Record is one accepted TCP connection or received UDP datagram.
type Record struct {
	// Proto is "tcp" or "udp".
	Proto string
	// Port is the listener's port.
	Port uint16
	// Local is the local address of the accepted socket (or the listener's
	// bound address for UDP).
	Local netip.AddrPort
	// OrigDst is the destination before NAT. It is invalid when the kernel
	// tracks no such connection (no conntrack in the namespace) and always
	// for UDP, where the socket API cannot tell.
	OrigDst netip.AddrPort
	// Peer is the remote address.
	Peer netip.AddrPort
	// Data holds the datagram payload (UDP only), at most MaxDatagram bytes.
	Data []byte
}

// Redirected reports whether NAT changed the destination on the way in.
func (r Record) Redirected() bool {
	return r.OrigDst.IsValid() && r.OrigDst != r.Local
}

// String renders the record for test failure messages.
func (r Record) String() string {
	return fmt.Sprintf("%s port=%d local=%s orig=%s peer=%s", r.Proto, r.Port, r.Local, r.OrigDst, r.Peer)
}

// Limits that keep a hostile or buggy client from holding resources.
const (
	// MaxDatagram is the largest UDP payload kept in a Record.
	MaxDatagram = 512
	// maxDrain is how much a TCP client may send before being cut off.
	maxDrain = 64 << 10
	// drainTimeout is how long a TCP connection may stay open.
	drainTimeout = 5 * time.Second
	// maxRecords bounds memory; older records are dropped first.
	maxRecords = 10000
)

// Config lists what to listen on.
type Config struct {
	// TCPPorts and UDPPorts are bound on 0.0.0.0 and, unless NoIPv6, [::]
	// (IPv6-only, so each family gets its own socket and its own
	// SO_ORIGINAL_DST flavour).
	TCPPorts []uint16
	UDPPorts []uint16
	// NoIPv6 skips the IPv6 listeners (for namespaces without IPv6).
	NoIPv6 bool
}

// Proxy is a running set of listeners. Close stops it and waits for every
// goroutine it started.
type Proxy struct {
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	records []Record
	notify  chan struct{} // closed and replaced on every new record
	closers []io.Closer
	conns   map[net.Conn]struct{}
}

// Start opens the listeners inside the network namespace at netnsPath ("" =
// the caller's namespace). The sockets stay in that namespace; serving them
// needs no namespace switching.
func Start(netnsPath string, cfg Config) (*Proxy, error) {
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{ctx: ctx, cancel: cancel, notify: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	var tcp []net.Listener
	var udp []net.PacketConn
	open := func() error {
		var lc net.ListenConfig
		nets := []struct{ tcp, udp, host string }{{"tcp4", "udp4", "0.0.0.0"}}
		if !cfg.NoIPv6 {
			nets = append(nets, struct{ tcp, udp, host string }{"tcp6", "udp6", "::"})
		}
		for _, n := range nets {
			for _, port := range cfg.TCPPorts {
				l, err := lc.Listen(ctx, n.tcp, net.JoinHostPort(n.host, strconv.Itoa(int(port))))
				if err != nil {
					return fmt.Errorf("listen %s port %d: %w", n.tcp, port, err)
				}
				tcp = append(tcp, l)
			}
			for _, port := range cfg.UDPPorts {
				ulc := net.ListenConfig{Control: pktinfoOn}
				c, err := ulc.ListenPacket(ctx, n.udp, net.JoinHostPort(n.host, strconv.Itoa(int(port))))
				if err != nil {
					return fmt.Errorf("listen %s port %d: %w", n.udp, port, err)
				}
				udp = append(udp, c)
			}
		}
		return nil
	}
	var err error
	if netnsPath == "" {
		err = open()
	} else {
		err = ns.WithNetNSPath(netnsPath, func(ns.NetNS) error { return open() })
	}
	if err != nil {
		for _, l := range tcp {
			_ = l.Close()
		}
		for _, c := range udp {
			_ = c.Close()
		}
		cancel()
		return nil, fmt.Errorf("capture proxy in netns %q: %w", netnsPath, err)
	}
	for _, l := range tcp {
		p.closers = append(p.closers, l)
		p.wg.Add(1)
		go p.serveTCP(l)
	}
	for _, c := range udp {
		p.closers = append(p.closers, c)
		p.wg.Add(1)
		go p.serveUDP(c)
	}
	return p, nil
}

// Close stops every listener and open connection and waits for the
// goroutines to end. It is safe to call more than once.
func (p *Proxy) Close() error {
	p.cancel()
	p.mu.Lock()
	for _, c := range p.closers {
		_ = c.Close()
	}
	p.closers = nil
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	return nil
}

// Addrs returns the bound address of every listener (useful with port 0).
func (p *Proxy) Addrs() []netip.AddrPort {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []netip.AddrPort
	for _, c := range p.closers {
		switch c := c.(type) {
		case net.Listener:
			out = append(out, addrPort(c.Addr()))
		case net.PacketConn:
			out = append(out, addrPort(c.LocalAddr()))
		}
	}
	return out
}

// Records returns a copy of everything recorded so far, oldest first.
func (p *Proxy) Records() []Record {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Record(nil), p.records...)
}

// Reset forgets the records.
func (p *Proxy) Reset() {
	p.mu.Lock()
	p.records = nil
	p.mu.Unlock()
}

// WaitFor returns the first record (oldest first, including ones already
// there) that match accepts, waiting until ctx ends.
func (p *Proxy) WaitFor(ctx context.Context, match func(Record) bool) (Record, error) {
	for {
		p.mu.Lock()
		for _, r := range p.records {
			if match(r) {
				p.mu.Unlock()
				return r, nil
			}
		}
		ch := p.notify
		p.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return Record{}, fmt.Errorf("no matching record: %w", ctx.Err())
		case <-p.ctx.Done():
			return Record{}, errors.New("no matching record: proxy closed")
		}
	}
}

func (p *Proxy) add(r Record) {
	p.mu.Lock()
	if len(p.records) >= maxRecords {
		p.records = p.records[1:]
	}
	p.records = append(p.records, r)
	close(p.notify)
	p.notify = make(chan struct{})
	p.mu.Unlock()
}

// track registers c for Close; it reports false when the proxy is closing.
func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ctx.Err() != nil {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
}

func (p *Proxy) serveTCP(l net.Listener) {
	defer p.wg.Done()
	port := uint16(l.Addr().(*net.TCPAddr).Port)
	for {
		c, err := l.Accept()
		if err != nil {
			if p.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			continue // e.g. EMFILE under load: keep serving
		}
		if !p.track(c) {
			_ = c.Close()
			return
		}
		p.wg.Add(1)
		go p.handleTCP(port, c.(*net.TCPConn))
	}
}

func (p *Proxy) handleTCP(port uint16, c *net.TCPConn) {
	defer p.wg.Done()
	defer p.untrack(c)
	defer c.Close()
	r := Record{Proto: "tcp", Port: port, Local: addrPort(c.LocalAddr()), Peer: addrPort(c.RemoteAddr())}
	r.OrigDst, _ = OriginalDst(c)
	p.add(r)
	_ = c.SetDeadline(time.Now().Add(drainTimeout))
	if _, err := io.WriteString(c, r.banner()); err != nil {
		return
	}
	// Drain until the client closes, bounded in bytes and time.
	_, _ = io.Copy(io.Discard, io.LimitReader(c, maxDrain))
}

func (p *Proxy) serveUDP(pc net.PacketConn) {
	defer p.wg.Done()
	c := pc.(*net.UDPConn)
	bound := addrPort(c.LocalAddr())
	buf := make([]byte, 64<<10)
	oob := make([]byte, 512)
	for {
		n, oobn, _, from, err := c.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			if p.ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		// The datagram's own destination: a wildcard socket must answer
		// from it, or conntrack cannot undo a REDIRECT on the reply.
		dst := pktDst(oob[:oobn])
		local := bound
		var reply []byte
		if dst.IsValid() {
			local = netip.AddrPortFrom(dst.Unmap(), bound.Port())
			reply = pktinfoFrom(dst)
		}
		r := Record{Proto: "udp", Port: bound.Port(), Local: local, Peer: unmap(from),
			Data: append([]byte(nil), buf[:min(n, MaxDatagram)]...)}
		p.add(r)
		_, _, _ = c.WriteMsgUDPAddrPort([]byte(r.banner()), reply, from)
	}
}

// pktinfoOn asks the kernel for each datagram's destination address.
func pktinfoOn(network, _ string, rc syscall.RawConn) error {
	var serr error
	err := rc.Control(func(fd uintptr) {
		if network == "udp6" {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_RECVPKTINFO, 1)
		} else {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_PKTINFO, 1)
		}
	})
	if err != nil {
		return err
	}
	return serr
}

// pktDst extracts the destination address from IP_PKTINFO/IPV6_PKTINFO.
func pktDst(oob []byte) netip.Addr {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return netip.Addr{}
	}
	for _, m := range msgs {
		switch {
		case m.Header.Level == unix.SOL_IP && m.Header.Type == unix.IP_PKTINFO && len(m.Data) >= unix.SizeofInet4Pktinfo:
			info := (*unix.Inet4Pktinfo)(unsafe.Pointer(&m.Data[0]))
			return netip.AddrFrom4(info.Addr)
		case m.Header.Level == unix.SOL_IPV6 && m.Header.Type == unix.IPV6_PKTINFO && len(m.Data) >= unix.SizeofInet6Pktinfo:
			info := (*unix.Inet6Pktinfo)(unsafe.Pointer(&m.Data[0]))
			return netip.AddrFrom16(info.Addr)
		}
	}
	return netip.Addr{}
}

// pktinfoFrom builds the control message that sets a reply's source.
func pktinfoFrom(a netip.Addr) []byte {
	if a.Is4() {
		return unix.PktInfo4(&unix.Inet4Pktinfo{Spec_dst: a.As4()})
	}
	return unix.PktInfo6(&unix.Inet6Pktinfo{Addr: a.As16()})
}

func addrPort(a net.Addr) netip.AddrPort {
	switch a := a.(type) {
	case *net.TCPAddr:
		return unmap(a.AddrPort())
	case *net.UDPAddr:
		return unmap(a.AddrPort())
	}
	return netip.AddrPort{}
}

func unmap(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// OriginalDst returns the destination a redirected TCP connection was
// addressed to before NAT. For a connection the kernel does not track it
// returns an invalid AddrPort and an error wrapping ENOENT.
func OriginalDst(c *net.TCPConn) (netip.AddrPort, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, err
	}
	v6 := addrPort(c.LocalAddr()).Addr().Is6()
	var res netip.AddrPort
	var serr error
	err = rc.Control(func(fd uintptr) {
		if v6 {
			var sa unix.RawSockaddrInet6
			if serr = getsockopt(fd, unix.SOL_IPV6, unix.SO_ORIGINAL_DST, unsafe.Pointer(&sa), unsafe.Sizeof(sa)); serr == nil {
				res = netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), ntohs(sa.Port))
			}
			return
		}
		var sa unix.RawSockaddrInet4
		if serr = getsockopt(fd, unix.SOL_IP, unix.SO_ORIGINAL_DST, unsafe.Pointer(&sa), unsafe.Sizeof(sa)); serr == nil {
			res = netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), ntohs(sa.Port))
		}
	})
	if err != nil {
		return netip.AddrPort{}, err
	}
	if serr != nil {
		return netip.AddrPort{}, fmt.Errorf("SO_ORIGINAL_DST: %w", serr)
	}
	return unmap(res), nil
}

// getsockopt fetches a struct-valued option; x/sys has no wrapper for
// SO_ORIGINAL_DST's sockaddr result.
func getsockopt(fd uintptr, level, opt int, val unsafe.Pointer, size uintptr) error {
	l := uint32(size)
	_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, fd, uintptr(level), uintptr(opt), uintptr(val), uintptr(unsafe.Pointer(&l)), 0)
	if e != 0 {
		return e
	}
	return nil
}

// ntohs converts the network-order port the kernel stored in a sockaddr.
func ntohs(p uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&p))
	return uint16(b[0])<<8 | uint16(b[1])
}

// banner is what the listener sends back: one line of key=value fields.
func (r Record) banner() string {
	orig := "-"
	if r.OrigDst.IsValid() {
		orig = r.OrigDst.String()
	}
	return fmt.Sprintf("captureproxy proto=%s port=%d local=%s orig=%s peer=%s\n", r.Proto, r.Port, r.Local, orig, r.Peer)
}

// maxBanner bounds what ParseBanner and Dial accept.
const maxBanner = 512

// ParseBanner parses a listener's banner line back into a Record (without
// Data). It rejects anything that is not exactly a banner.
func ParseBanner(line string) (Record, error) {
	if len(line) > maxBanner {
		return Record{}, fmt.Errorf("banner longer than %d bytes", maxBanner)
	}
	line = strings.TrimSuffix(line, "\n")
	f := strings.Split(line, " ")
	if len(f) != 6 || f[0] != "captureproxy" {
		return Record{}, fmt.Errorf("not a capture proxy banner: %q", line)
	}
	var r Record
	seen := map[string]bool{}
	for _, kv := range f[1:] {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || seen[k] {
			return Record{}, fmt.Errorf("bad banner field %q", kv)
		}
		seen[k] = true
		var err error
		switch k {
		case "proto":
			if v != "tcp" && v != "udp" {
				err = fmt.Errorf("bad proto %q", v)
			}
			r.Proto = v
		case "port":
			var n uint64
			n, err = strconv.ParseUint(v, 10, 16)
			r.Port = uint16(n)
		case "local":
			r.Local, err = netip.ParseAddrPort(v)
		case "orig":
			if v != "-" {
				r.OrigDst, err = netip.ParseAddrPort(v)
			}
		case "peer":
			r.Peer, err = netip.ParseAddrPort(v)
		default:
			err = fmt.Errorf("unknown field %q", k)
		}
		if err != nil {
			return Record{}, fmt.Errorf("banner field %s: %w", k, err)
		}
	}
	return r, nil
}
