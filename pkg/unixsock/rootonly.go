package unixsock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"

	"golang.org/x/sys/unix"
)

type peerKey struct{}

type peer struct {
	cred *unix.Ucred
	err  error
}

// ConnContext is an http.Server ConnContext for a server on a Unix socket:
// it records the connecting process's credentials (SO_PEERCRED, fixed at
// connect time) for RootOnly. Any other kind of connection records that
// its peer is unknown.
func ConnContext(ctx context.Context, c net.Conn) context.Context {
	p := peer{err: errors.New("not a unix socket")}
	if uc, ok := c.(*net.UnixConn); ok {
		p.cred, p.err = PeerCred(uc)
	}
	return context.WithValue(ctx, peerKey{}, p)
}

// RootOnly serves next only to requests whose peer, as ConnContext
// recorded it, is uid 0. The socket's mode says so already; this holds
// even if the mode is loosened by hand. Every other request is logged and
// handed to refuse with why it was refused (the peer's uid, or why its
// credentials are unknown); refuse answers it in the server's own format,
// as 403.
func RootOnly(next http.Handler, log *slog.Logger, refuse func(w http.ResponseWriter, r *http.Request, why error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, ok := r.Context().Value(peerKey{}).(peer)
		switch {
		case !ok:
			log.Warn("refusing request: peer credentials not recorded")
			refuse(w, r, errors.New("peer credentials unavailable"))
		case p.err != nil || p.cred == nil:
			log.Warn("refusing request: peer credentials unknown", "err", p.err)
			refuse(w, r, fmt.Errorf("peer credentials unavailable: %v", p.err))
		case p.cred.Uid != 0:
			log.Warn("refusing request from non-root peer", "uid", p.cred.Uid, "pid", p.cred.Pid)
			refuse(w, r, fmt.Errorf("peer uid %d is not root", p.cred.Uid))
		default:
			next.ServeHTTP(w, r)
		}
	})
}
