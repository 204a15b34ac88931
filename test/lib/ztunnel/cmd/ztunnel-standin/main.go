// Command ztunnel-standin runs the test ztunnel stand-in against a node
// agent's ZDS socket until SIGTERM or SIGINT. With -debug-addr it serves its
// state as JSON (GET /workloads, /records and /messages) and takes faults
// to inject: POST /close-listeners?uid=UID closes one pod's in-pod
// listeners, as a ztunnel that lost them (the pod's next Del and Add open
// them again); POST /deaf?uid=UID closes them for good, as a ztunnel that
// lost the pod: it acks the pod's later Adds without listening, until
// DELETE /deaf?uid=UID.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

func main() {
	socket := flag.String("socket", ambient.DefaultZDSSocket, "node agent ZDS socket")
	debugAddr := flag.String("debug-addr", "", "serve state as JSON on this address (empty: off)")
	verbose := flag.Bool("v", false, "debug logging")
	flag.Parse()

	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()

	z := ztunnel.New(ztunnel.Config{SocketPath: *socket, Logger: log})
	if *debugAddr != "" {
		ln, err := net.Listen("tcp", *debugAddr)
		if err != nil {
			log.Error("debug listener", "err", err)
			os.Exit(1)
		}
		srv := &http.Server{Handler: debugMux(z), ReadHeaderTimeout: 5 * time.Second}
		go func() { // owner: main; shut down below
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Error("debug server", "err", err)
			}
		}()
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
		log.Info("debug endpoint", "addr", ln.Addr().String())
	}
	go watchStalls(ctx, log) // owner: main; ends with ctx
	if err := z.Run(ctx); err != nil {
		log.Error("stand-in", "err", err)
		os.Exit(1)
	}
}

func debugMux(z *ztunnel.StandIn) *http.ServeMux {
	mux := http.NewServeMux()
	serve := func(path string, get func() any) {
		mux.HandleFunc("GET "+path, func(w http.ResponseWriter, _ *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_ = json.NewEncoder(w).Encode(get())
		})
	}
	serve("/workloads", func() any { return z.Workloads() })
	serve("/records", func() any { return z.Records() })
	serve("/messages", func() any { return z.Messages() })
	// The captured pods of other nodes (a JSON list of addresses): their
	// traffic goes through the tunnel.
	mux.HandleFunc("PUT /remote", func(w http.ResponseWriter, r *http.Request) {
		var addrs []netip.Addr
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&addrs); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		z.SetRemote(addrs)
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("POST /close-listeners", func(w http.ResponseWriter, r *http.Request) {
		if !z.CloseListeners(r.URL.Query().Get("uid")) {
			http.Error(w, "no such pod served", http.StatusNotFound)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	d := &deafPods{uids: map[string]bool{}}
	z.SetFaults(ztunnel.Faults{Deaf: d.has})
	mux.HandleFunc("POST /deaf", func(w http.ResponseWriter, r *http.Request) {
		uid := r.URL.Query().Get("uid")
		// Deaf before the listeners close, so no Add in between opens them.
		if !d.set(uid, true) {
			http.Error(w, "already deaf to the pod", http.StatusConflict)
			return
		}
		if !z.CloseListeners(uid) {
			d.set(uid, false)
			http.Error(w, "no such pod served", http.StatusNotFound)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	mux.HandleFunc("DELETE /deaf", func(w http.ResponseWriter, r *http.Request) {
		if !d.set(r.URL.Query().Get("uid"), false) {
			http.Error(w, "not deaf to the pod", http.StatusNotFound)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	return mux
}

// deafPods are the pods the stand-in acks without listening in them.
type deafPods struct {
	mu   sync.Mutex
	uids map[string]bool
}

func (d *deafPods) has(uid string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.uids[uid]
}

// set makes the stand-in deaf to uid or not; false when it already was
// (or was not).
func (d *deafPods) set(uid string, deaf bool) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.uids[uid] == deaf {
		return false
	}
	if deaf {
		d.uids[uid] = true
	} else {
		delete(d.uids, uid)
	}
	return true
}

// watchStalls logs every stretch of a second or more in which the process
// was not scheduled (a starved container, a stopped process): the agent's
// ack deadline and the tests' timeouts read differently once it is known
// that the stand-in itself stood still.
func watchStalls(ctx context.Context, log *slog.Logger) {
	const tick = 250 * time.Millisecond
	t := time.NewTicker(tick)
	defer t.Stop()
	last := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			if gap := now.Sub(last); gap >= time.Second+tick {
				log.Warn("stand-in stalled: not scheduled", "for", (gap - tick).Round(time.Millisecond))
			}
			last = now
		}
	}
}
