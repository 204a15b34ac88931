// Package podapp is the small HTTP application the real node's demo and
// end-to-end tests run in pods: it answers requests, has readiness and
// liveness endpoints for kubelet probes, logs who called it (so a test can
// see where a probe came from), and makes requests itself — on demand, at
// start, in a preStop hook and while terminating — so that tests can see
// whether a pod's own traffic was captured.
package podapp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// Entry is one request the app served.
type Entry struct {
	Time   time.Time `json:"time"`
	Method string    `json:"method"`
	Path   string    `json:"path"` // with the query
	Remote string    `json:"remote"`
}

// FetchResult is what /fetch answers.
type FetchResult struct {
	Status int    `json:"status"`
	Body   string `json:"body"`
	Err    string `json:"err,omitempty"`
}

// maxLog bounds the request log: probes arrive forever.
const maxLog = 2000

// Server is the app's HTTP side.
type Server struct {
	// Name is put in every answer (the pod's name).
	Name string

	mu  sync.Mutex
	log []Entry
}

// Handler serves:
//
//	/          "<name>\n"
//	/ready     readiness probe, "ok"
//	/live      liveness probe, "ok"
//	/log       the request log as JSON (not itself logged)
//	/fetch?url=U  GET U from inside the pod, the result as JSON
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		s.record(r)
		fmt.Fprintf(w, "%s\n", s.Name)
	})
	ok := func(w http.ResponseWriter, r *http.Request) {
		s.record(r)
		_, _ = io.WriteString(w, "ok\n")
	}
	mux.HandleFunc("GET /ready", ok)
	mux.HandleFunc("GET /live", ok)
	mux.HandleFunc("GET /log", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(s.Log())
	})
	mux.HandleFunc("GET /fetch", func(w http.ResponseWriter, r *http.Request) {
		s.record(r)
		url := r.URL.Query().Get("url")
		res := FetchResult{}
		if url == "" {
			w.WriteHeader(http.StatusBadRequest)
			res.Err = "missing url parameter"
		} else {
			ctx, cancel := context.WithTimeout(r.Context(), 10*time.Second)
			res.Status, res.Body, res.Err = fetch(ctx, url)
			cancel()
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(res)
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		// Any other path is logged too: tests mark requests by path.
		s.record(r)
		fmt.Fprintf(w, "%s\n", s.Name)
	})
	return mux
}

func (s *Server) record(r *http.Request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.log) == maxLog {
		s.log = append(s.log[:0], s.log[maxLog/2:]...)
	}
	s.log = append(s.log, Entry{Time: time.Now(), Method: r.Method, Path: r.URL.RequestURI(), Remote: r.RemoteAddr})
}

// Log returns a copy of the request log.
func (s *Server) Log() []Entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Entry(nil), s.log...)
}

// client makes every request over a fresh connection (no keep-alive), so
// that each request is one connection a ztunnel stand-in can record.
var client = &http.Client{Transport: &http.Transport{
	DisableKeepAlives: true,
	Proxy:             nil,
	DialContext:       (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
}}

func fetch(ctx context.Context, url string) (int, string, string) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err.Error()
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", err.Error()
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return resp.StatusCode, string(body), err.Error()
	}
	return resp.StatusCode, string(body), ""
}

// Get makes one GET, retrying failures every 200ms until ctx ends, and
// returns the body of the first 200 answer.
func Get(ctx context.Context, url string) (string, error) {
	var last error
	for {
		status, body, errText := fetch(ctx, url)
		switch {
		case errText != "":
			last = errors.New(errText)
		case status != http.StatusOK:
			last = fmt.Errorf("status %d: %s", status, body)
		default:
			return body, nil
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("GET %s: %w (last error: %v)", url, ctx.Err(), last)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
