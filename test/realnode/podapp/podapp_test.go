package podapp

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestServerLogsCallers(t *testing.T) {
	s := &Server{Name: "app-1"}
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()
	for _, p := range []string{"/", "/ready", "/live", "/marker?x=1"} {
		if code, body := get(t, ts.URL+p); code != 200 || body == "" {
			t.Errorf("%s: %d %q", p, code, body)
		}
	}
	code, body := get(t, ts.URL+"/log")
	if code != 200 {
		t.Fatalf("/log: %d", code)
	}
	var entries []Entry
	if err := json.Unmarshal([]byte(body), &entries); err != nil {
		t.Fatal(err)
	}
	var paths []string
	for _, e := range entries {
		paths = append(paths, e.Path)
		if !strings.HasPrefix(e.Remote, "127.0.0.1:") {
			t.Errorf("remote %q", e.Remote)
		}
	}
	if got := strings.Join(paths, " "); got != "/ /ready /live /marker?x=1" {
		t.Errorf("logged %q (the /log call itself must not be logged)", got)
	}
}

func TestFetch(t *testing.T) {
	peer := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "peer\n") }))
	defer peer.Close()
	s := &Server{Name: "a"}
	ts := httptest.NewServer(s.Handler())
	defer ts.Close()
	_, body := get(t, ts.URL+"/fetch?url="+peer.URL)
	var res FetchResult
	if err := json.Unmarshal([]byte(body), &res); err != nil {
		t.Fatal(err)
	}
	if res.Status != 200 || res.Body != "peer\n" || res.Err != "" {
		t.Errorf("fetch %+v", res)
	}
	code, body := get(t, ts.URL+"/fetch")
	if code != http.StatusBadRequest || !strings.Contains(body, "missing url") {
		t.Errorf("fetch without url: %d %q", code, body)
	}
	peer.Close()
	_, body = get(t, ts.URL+"/fetch?url="+peer.URL)
	if err := json.Unmarshal([]byte(body), &res); err != nil || res.Err == "" {
		t.Errorf("fetch from a closed peer: %q", body)
	}
}

func TestLogIsBounded(t *testing.T) {
	s := &Server{}
	r := httptest.NewRequest("GET", "/ready", nil)
	for range 3 * maxLog {
		s.record(r)
	}
	if n := len(s.Log()); n > maxLog {
		t.Fatalf("log holds %d entries, bound %d", n, maxLog)
	}
}

func TestGetRetriesUntilDeadline(t *testing.T) {
	calls := 0
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		calls++
		if calls < 3 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "up")
	}))
	defer ts.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if body, err := Get(ctx, ts.URL); err != nil || body != "up" {
		t.Fatalf("Get: %q %v", body, err)
	}
	ts.Close()
	ctx, cancel = context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if _, err := Get(ctx, ts.URL); err == nil {
		t.Fatal("Get of a closed server succeeded")
	}
}
