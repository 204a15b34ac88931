package ambient

import (
	"bufio"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
)

func TestReadResponse(t *testing.T) {
	ok := map[string]struct {
		in     string
		status int
		body   string
	}{
		"content-length": {"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}", 200, "{}"},
		"until EOF":      {"HTTP/1.0 503 Service Unavailable\r\n\r\n{\"error\":\"x\"}", 503, `{"error":"x"}`},
		"bare LF":        {"HTTP/1.1 400 Bad Request\nContent-Length: 1\n\nx", 400, "x"},
		"no reason":      {"HTTP/1.1 200\r\nContent-Length: 0\r\n\r\n", 200, ""},
		"identity te":    {"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\n\r\nab", 200, "ab"},
	}
	for name, tc := range ok {
		st, body, err := ReadResponse(bufio.NewReader(strings.NewReader(tc.in)))
		if err != nil || st != tc.status || string(body) != tc.body {
			t.Errorf("%s: got %d %q %v", name, st, body, err)
		}
	}
	bad := map[string]string{
		"empty":             "",
		"garbage":           "garbage\r\n\r\n",
		"http2":             "HTTP/2 200 OK\r\n\r\n",
		"bad code":          "HTTP/1.1 2x0 OK\r\n\r\n",
		"short code":        "HTTP/1.1 20 OK\r\n\r\n",
		"header no colon":   "HTTP/1.1 200 OK\r\nbroken\r\n\r\n",
		"negative length":   "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
		"two lengths":       "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
		"chunked":           "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
		"short body":        "HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{}",
		"huge length":       "HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n",
		"no header end":     "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n",
		"huge header":       "HTTP/1.1 200 OK\r\nX: " + strings.Repeat("a", maxResponseHeader) + "\r\n\r\n",
		"many headers":      "HTTP/1.1 200 OK\r\n" + strings.Repeat("X: y\r\n", maxResponseHeader/6+1) + "\r\n",
		"huge body to EOF":  "HTTP/1.0 200 OK\r\n\r\n" + strings.Repeat("a", maxResponseBody+1),
		"huge status line":  "HTTP/1.1 200 " + strings.Repeat("a", maxResponseHeader+1),
		"length overflow":   "HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n",
		"length not number": "HTTP/1.1 200 OK\r\nContent-Length: 0x10\r\n\r\n",
	}
	for name, in := range bad {
		if st, body, err := ReadResponse(bufio.NewReader(strings.NewReader(in))); err == nil {
			t.Errorf("%s: accepted as %d %q", name, st, truncate(string(body)))
		}
	}
}

func TestEncodeRequest(t *testing.T) {
	got := string(encodeRequest("POST", "/v1/pod-event", []byte(`{"a":1}`)))
	want := "POST /v1/pod-event HTTP/1.0\r\nHost: ambient-cni-agent\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{\"a\":1}"
	if got != want {
		t.Errorf("got %q\nwant %q", got, want)
	}
	if got := string(encodeRequest("GET", "/v1/status", nil)); got != "GET /v1/status HTTP/1.0\r\nHost: ambient-cni-agent\r\n\r\n" {
		t.Errorf("GET rendered as %q", got)
	}
}

func FuzzReadResponse(f *testing.F) {
	fuzzseed.Add(f, "FuzzReadResponse")
	f.Add([]byte("HTTP/1.1 200 OK\r\nContent-Length: 22\r\n\r\n{\"verdict\":\"enrolled\"}"))
	f.Fuzz(func(t *testing.T, b []byte) {
		st, body, err := ReadResponse(bufio.NewReader(strings.NewReader(string(b))))
		if err != nil {
			return
		}
		if st < 100 || st > 999 || len(body) > maxResponseBody {
			t.Fatalf("accepted status %d with %d-byte body", st, len(body))
		}
	})
}
