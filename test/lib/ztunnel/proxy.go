package ztunnel

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/captureproxy"
	"golang.org/x/sys/unix"
)

// pod is one served workload: its netns handle, in-pod listeners and the
// connections being proxied. stop ends all of it.
type pod struct {
	z    *StandIn
	uid  string
	info WorkloadInfo
	nsfd int
	ns   NetnsID
	ips  []netip.Addr

	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex
	lns    []listener
	active map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup
}

type listener struct {
	net.Listener
	port int
}

// podPorts are the in-pod TCP listeners, ztunnel's: 15053 is its DNS
// proxy's, held as ztunnel holds it (the verifier proves it) though the
// stand-in answers no DNS.
var podPorts = []int{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort, ambient.ZtunnelInboundHBONEPort, ambient.ZtunnelDNSPort}

// startPod opens the in-pod listeners (none unless listen); it owns nsfd
// from here on (closed on failure or by stop).
func (z *StandIn) startPod(uid string, info WorkloadInfo, nsfd int, id NetnsID, listen bool) (*pod, error) {
	ips, err := podAddrs(nsfd)
	if err != nil {
		_ = unix.Close(nsfd)
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &pod{z: z, uid: uid, info: info, nsfd: nsfd, ns: id, ips: ips, ctx: ctx, cancel: cancel, active: map[net.Conn]struct{}{}}
	has6 := slices.ContainsFunc(ips, func(a netip.Addr) bool { return a.Is6() })
	ports := podPorts
	if !listen {
		ports = nil
	}
	for _, port := range ports {
		for _, network := range []string{"tcp4", "tcp6"} {
			ln, err := listenIn(nsfd, network, port)
			if err != nil {
				if network == "tcp6" && !has6 {
					continue // IPv6 may be disabled in a v4-only pod
				}
				p.stop()
				return nil, fmt.Errorf("listen %s/%d in pod netns: %w", network, port, err)
			}
			p.lns = append(p.lns, listener{ln, port})
		}
	}
	for _, l := range p.lns {
		p.wg.Add(1)
		go p.acceptLoop(l) // owner: p; ends when stop closes the listener
	}
	return p, nil
}

func (p *pod) view() Workload {
	w := Workload{UID: p.uid, Info: p.info, Netns: p.ns, IPs: slices.Clone(p.ips)}
	p.mu.Lock()
	for _, l := range p.lns {
		w.Ports = append(w.Ports, l.port)
	}
	p.mu.Unlock()
	return w
}

// stop closes the listeners, every proxied connection and the netns
// handle, and waits for the pod's goroutines.
func (p *pod) stop() {
	p.cancel()
	p.mu.Lock()
	p.closed = true
	for _, l := range p.lns {
		_ = l.Close()
	}
	for c := range p.active {
		_ = c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
	_ = unix.Close(p.nsfd)
}

// track registers a connection for stop; false when the pod is stopping.
func (p *pod) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.active[c] = struct{}{}
	return true
}

func (p *pod) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.active, c)
	p.mu.Unlock()
	_ = c.Close()
}

func (p *pod) acceptLoop(l listener) {
	defer p.wg.Done()
	for {
		c, err := l.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) || p.ctx.Err() != nil {
				return
			}
			p.z.log.Warn("stand-in accept failed", "uid", p.uid, "port", l.port, "err", err)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		tc := c.(*net.TCPConn)
		if !p.track(tc) {
			_ = tc.Close()
			return
		}
		p.wg.Add(1)
		go p.handle(tc, l.port) // owner: p
	}
}

func addrPortOf(a net.Addr) netip.AddrPort {
	if t, ok := a.(*net.TCPAddr); ok {
		ap := t.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	return netip.AddrPort{}
}

func (p *pod) handle(c *net.TCPConn, port int) {
	defer p.wg.Done()
	defer p.untrack(c)
	rec := Record{UID: p.uid, Port: port, Source: addrPortOf(c.RemoteAddr())}
	var src io.Reader = c
	var up net.Conn
	var err error
	switch port {
	case ambient.ZtunnelOutboundPort:
		up, err = p.outbound(c, &rec)
	case ambient.ZtunnelInboundPlaintextPort:
		up, err = p.inboundPlain(c, &rec)
	case ambient.ZtunnelInboundHBONEPort:
		_ = c.SetReadDeadline(time.Now().Add(p.z.cfg.DialTimeout))
		br := bufio.NewReaderSize(c, maxConnectLine)
		if isHTTP2(br) {
			_ = c.SetReadDeadline(time.Time{})
			p.serveHBONE(c, br, rec)
			return
		}
		src, up, err = p.inboundTunnel(c, br, &rec)
	default:
		err = errors.New("the stand-in answers no DNS")
	}
	if err != nil {
		rec.Err = err.Error()
		p.z.record(rec)
		p.z.log.Info("stand-in did not proxy", "uid", p.uid, "port", port, "err", err)
		return
	}
	if !p.track(up) {
		_ = up.Close()
		return
	}
	defer p.untrack(up)
	p.z.record(rec)
	pipe(c, src, up)
}

// outbound (15001): tunnel to the destination pod's 15008 when it is a pod
// this stand-in serves, else connect to the destination directly.
func (p *pod) outbound(c *net.TCPConn, rec *Record) (net.Conn, error) {
	orig, err := captureproxy.OriginalDst(c)
	if err != nil {
		return nil, err
	}
	rec.OrigDst = orig
	if orig == addrPortOf(c.LocalAddr()) {
		return nil, errors.New("connection was not redirected (no original destination)")
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.z.cfg.DialTimeout)
	defer cancel()
	if p.z.inMesh(orig.Addr()) {
		rec.Tunneled = true
		rec.Upstream = netip.AddrPortFrom(orig.Addr(), ambient.ZtunnelInboundHBONEPort)
		raw, err := dialFrom(ctx, p.nsfd, rec.Upstream)
		if err != nil {
			return nil, fmt.Errorf("dial tunnel %s: %w", rec.Upstream, err)
		}
		return dialHBONE(p.ctx, raw, orig, p.z.cfg.DialTimeout)
	}
	rec.Upstream = orig
	up, err := dialFrom(ctx, p.nsfd, orig)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", orig, err)
	}
	return up, nil
}

// inboundPlain (15006): connect to the original destination inside the pod.
func (p *pod) inboundPlain(c *net.TCPConn, rec *Record) (net.Conn, error) {
	orig, err := captureproxy.OriginalDst(c)
	if err != nil {
		return nil, err
	}
	rec.OrigDst, rec.Upstream = orig, orig
	if orig == addrPortOf(c.LocalAddr()) {
		return nil, errors.New("connection was not redirected (no original destination)")
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.z.cfg.DialTimeout)
	defer cancel()
	up, err := dialFrom(ctx, p.nsfd, orig)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", orig, err)
	}
	return up, nil
}

// inboundTunnel (15008): read the header and connect to the named port of
// one of this pod's own addresses. Bytes read past the header are kept in
// the returned reader.
func (p *pod) inboundTunnel(c *net.TCPConn, br *bufio.Reader, rec *Record) (io.Reader, net.Conn, error) {
	line, err := br.ReadSlice('\n')
	if err != nil {
		return nil, nil, fmt.Errorf("read tunnel header: %w", err)
	}
	target, err := parseConnectLine(line)
	if err != nil {
		return nil, nil, err
	}
	rec.OrigDst, rec.Upstream = target, target
	if !slices.Contains(p.ips, target.Addr()) {
		return nil, nil, fmt.Errorf("tunnel target %s is not an address of this pod", target)
	}
	if err := c.SetReadDeadline(time.Time{}); err != nil {
		return nil, nil, err
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.z.cfg.DialTimeout)
	defer cancel()
	up, err := dialFrom(ctx, p.nsfd, target)
	if err != nil {
		return nil, nil, fmt.Errorf("dial %s: %w", target, err)
	}
	return br, up, nil
}

// pipe copies both ways, half-closing each side when its source ends.
func pipe(c *net.TCPConn, src io.Reader, up net.Conn) {
	done := make(chan struct{})
	go func() { // owner: pipe, which waits on done
		defer close(done)
		_, _ = io.Copy(up, src)
		if hc, ok := up.(interface{ CloseWrite() error }); ok {
			_ = hc.CloseWrite()
		}
	}()
	_, _ = io.Copy(c, up)
	_ = c.CloseWrite()
	<-done
}
