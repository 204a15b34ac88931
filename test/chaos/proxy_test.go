package chaos

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"
)

// apiProxy is a TCP proxy in front of the API server that the agent's
// kubeconfig names: Cut makes the API server unreachable for the agent
// alone (connections reset, new ones refused), as when it goes away, while
// the test's own clients still reach it; Resume lets the agent back.
type apiProxy struct {
	t        *testing.T
	addr     string
	upstream string

	mu    sync.Mutex
	ln    net.Listener
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// newAPIProxy proxies to the API server at upstreamURL until the test ends.
func newAPIProxy(t *testing.T, upstreamURL string) *apiProxy {
	t.Helper()
	u, err := url.Parse(upstreamURL)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &apiProxy{t: t, addr: ln.Addr().String(), upstream: u.Host, conns: map[net.Conn]struct{}{}}
	p.serve(ln)
	t.Cleanup(func() {
		p.Cut()
		p.wg.Wait()
	})
	return p
}

// URL is the proxy's address as a kubeconfig names a server.
func (p *apiProxy) URL() string { return "https://" + p.addr }

func (p *apiProxy) serve(ln net.Listener) {
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	p.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.wg.Go(func() { p.pipe(c) })
		}
	})
}

func (p *apiProxy) pipe(c net.Conn) {
	up, err := net.DialTimeout("tcp", p.upstream, 5*time.Second)
	if err != nil {
		_ = c.Close()
		return
	}
	if !p.track(c, up) {
		return
	}
	var wg sync.WaitGroup
	cp := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		_ = dst.Close()
		_ = src.Close()
	}
	wg.Go(func() { cp(up, c) })
	wg.Go(func() { cp(c, up) })
	wg.Wait()
	p.mu.Lock()
	delete(p.conns, c)
	delete(p.conns, up)
	p.mu.Unlock()
}

// track records a proxied pair; false (both closed) once cut.
func (p *apiProxy) track(c, up net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln == nil {
		_ = c.Close()
		_ = up.Close()
		return false
	}
	p.conns[c], p.conns[up] = struct{}{}, struct{}{}
	return true
}

// Cut closes the listener and every proxied connection.
func (p *apiProxy) Cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		_ = p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		_ = c.Close()
	}
}

// Resume listens again on the same address.
func (p *apiProxy) Resume() {
	p.t.Helper()
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		p.t.Fatalf("resume the API proxy on %s: %v", p.addr, err)
	}
	p.serve(ln)
}
