package ztunnel

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"sync"
	"time"
)

// The tunnel between pods is shaped like ztunnel's HBONE: an HTTP/2
// CONNECT stream to the destination pod's 15008 whose :authority is the
// original destination, answered 200 before the bytes flow both ways. It
// runs over plaintext HTTP/2 (prior knowledge), without HBONE's mTLS: the
// in-pod rules see the same ports, marks and addresses either way. One
// stream per connection, one connection per stream.

// h2c is plaintext HTTP/2 with prior knowledge, and nothing else.
func h2c() *http.Protocols {
	p := new(http.Protocols)
	p.SetUnencryptedHTTP2(true)
	return p
}

// hboneConn is the client side of one CONNECT stream.
type hboneConn struct {
	net.Conn // the TCP connection to the peer's 15008 (addresses, deadlines)
	cc       *http.ClientConn
	body     io.ReadCloser
	w        *io.PipeWriter
}

func (h *hboneConn) Read(b []byte) (int, error)  { return h.body.Read(b) }
func (h *hboneConn) Write(b []byte) (int, error) { return h.w.Write(b) }

// CloseWrite ends the request stream (END_STREAM), as a TCP half-close.
func (h *hboneConn) CloseWrite() error { return h.w.Close() }

func (h *hboneConn) Close() error {
	_ = h.w.Close()
	_ = h.body.Close()
	_ = h.cc.Close()
	return h.Conn.Close()
}

// dialHBONE opens a CONNECT stream for target over raw, a connection to
// the destination pod's 15008; ctx bounds the stream's whole life, timeout
// the wait for the answer. raw is closed on failure.
func dialHBONE(ctx context.Context, raw net.Conn, target netip.AddrPort, timeout time.Duration) (net.Conn, error) {
	t := &http.Transport{
		Protocols: h2c(),
		// The connection is made already, from inside the pod's netns.
		DialContext: func(context.Context, string, string) (net.Conn, error) { return raw, nil },
	}
	dctx, cancel := context.WithTimeout(ctx, timeout)
	cc, err := t.NewClientConn(dctx, "http", raw.RemoteAddr().String())
	cancel()
	if err != nil {
		_ = raw.Close()
		return nil, fmt.Errorf("HTTP/2 to %s: %w", raw.RemoteAddr(), err)
	}
	pr, pw := io.Pipe()
	req, err := http.NewRequestWithContext(ctx, http.MethodConnect, "", pr)
	if err != nil {
		_ = cc.Close()
		_ = raw.Close()
		return nil, err
	}
	req.URL = &url.URL{Host: target.String()}
	req.Host = target.String()
	type result struct {
		resp *http.Response
		err  error
	}
	done := make(chan result, 1)
	go func() { // owner: dialHBONE, which waits on done
		resp, err := cc.RoundTrip(req)
		done <- result{resp, err}
	}()
	var r result
	select {
	case r = <-done:
	case <-time.After(timeout):
		_ = pw.Close()
		_ = cc.Close()
		_ = raw.Close()
		<-done
		return nil, fmt.Errorf("CONNECT %s: no answer in %v", target, timeout)
	}
	if r.err == nil && r.resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(r.resp.Body, 512))
		_ = r.resp.Body.Close()
		r.err = fmt.Errorf("%s: %s", r.resp.Status, b)
	}
	if r.err != nil {
		_ = pw.Close()
		_ = cc.Close()
		_ = raw.Close()
		return nil, fmt.Errorf("CONNECT %s: %w", target, r.err)
	}
	return &hboneConn{Conn: raw, cc: cc, body: r.resp.Body, w: pw}, nil
}

// bufferedConn reads through a bufio.Reader that may hold bytes already
// read from the connection.
type bufferedConn struct {
	*net.TCPConn
	r *bufio.Reader
}

func (b *bufferedConn) Read(p []byte) (int, error) { return b.r.Read(p) }

// isHTTP2 reports whether a 15008 connection starts with the HTTP/2
// preface ("PRI * HTTP/2.0...") rather than the plain "CONNECT ip:port\n"
// header; both are at least three bytes long.
func isHTTP2(br *bufio.Reader) bool {
	b, err := br.Peek(3)
	return err == nil && string(b) == "PRI"
}

// serveHBONE serves CONNECT streams on a 15008 connection: each to one of
// this pod's own addresses, one record each. It returns when the
// connection is closed.
func (p *pod) serveHBONE(c *net.TCPConn, br *bufio.Reader, base Record) {
	done := make(chan struct{})
	var once sync.Once
	srv := &http.Server{
		Protocols:   h2c(),
		BaseContext: func(net.Listener) context.Context { return p.ctx },
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			p.hboneStream(w, r, base)
		}),
		ConnState: func(_ net.Conn, s http.ConnState) {
			if s == http.StateClosed || s == http.StateHijacked {
				once.Do(func() { close(done) })
			}
		},
		ErrorLog: log.New(io.Discard, "", 0),
	}
	_ = srv.Serve(&oneConn{c: &bufferedConn{TCPConn: c, r: br}, done: done})
	<-done
}

// oneConn is a listener of one connection: Accept hands it out, then
// waits until it is closed.
type oneConn struct {
	c    net.Conn
	done chan struct{}
	used bool
}

func (o *oneConn) Accept() (net.Conn, error) {
	if !o.used {
		o.used = true
		return o.c, nil
	}
	<-o.done
	return nil, net.ErrClosed
}

func (o *oneConn) Close() error   { return nil }
func (o *oneConn) Addr() net.Addr { return o.c.LocalAddr() }

func (p *pod) hboneStream(w http.ResponseWriter, r *http.Request, rec Record) {
	fail := func(code int, err error) {
		rec.Err = err.Error()
		p.z.record(rec)
		http.Error(w, err.Error(), code)
	}
	if r.Method != http.MethodConnect {
		fail(http.StatusMethodNotAllowed, fmt.Errorf("%s, not CONNECT", r.Method))
		return
	}
	target, err := netip.ParseAddrPort(r.Host)
	if err != nil {
		fail(http.StatusBadRequest, fmt.Errorf("CONNECT authority %q: %w", r.Host, err))
		return
	}
	target = netip.AddrPortFrom(target.Addr().Unmap(), target.Port())
	rec.OrigDst, rec.Upstream = target, target
	if !slices.Contains(p.ips, target.Addr()) {
		fail(http.StatusBadRequest, fmt.Errorf("tunnel target %s is not an address of this pod", target))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), p.z.cfg.DialTimeout)
	up, err := dialFrom(ctx, p.nsfd, target)
	cancel()
	if err != nil {
		fail(http.StatusServiceUnavailable, fmt.Errorf("dial %s: %w", target, err))
		return
	}
	if !p.track(up) {
		_ = up.Close()
		return
	}
	defer p.untrack(up)
	p.z.record(rec)
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	_ = rc.Flush()
	done := make(chan struct{})
	go func() { // owner: hboneStream, which waits on done
		defer close(done)
		_, _ = io.Copy(up, r.Body)
		if tc, ok := up.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := up.Read(buf)
		if n > 0 {
			if _, werr := w.Write(buf[:n]); werr != nil {
				break
			}
			_ = rc.Flush()
		}
		if err != nil {
			if !errors.Is(err, io.EOF) {
				p.z.log.Debug("stand-in tunnel upstream", "err", err)
			}
			break
		}
	}
	// The response ends here (END_STREAM): the client reads EOF.
	_ = up.Close()
	<-done
}
