package ambient

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// Client is the plugin's side of the exchange with the node agent:
// HTTP+JSON over its Unix socket, one request per connection. It speaks
// just enough HTTP/1.0 for that instead of importing net/http, which would
// double the plugin binary and its start-up time; HTTP/1.0 keeps the
// agent's answer unchunked and lets the connection's end mark the end of
// the body.
type Client struct {
	// Socket is the agent's Unix socket path.
	Socket string
}

// UnreachableError means the agent could not be reached at all (nothing
// listening, no socket file): the request certainly had no effect.
type UnreachableError struct {
	Socket string
	Err    error
}

// Error describes the wrapped error.
func (e *UnreachableError) Error() string {
	return fmt.Sprintf("node agent unreachable at %s: %v", e.Socket, e.Err)
}

// Unwrap returns the wrapped error.
func (e *UnreachableError) Unwrap() error { return e.Err }

// ExchangeError means the agent was reached but the exchange failed
// (timeout, connection dropped, unreadable answer): the request may or may
// not have taken effect.
type ExchangeError struct {
	Op  string
	Err error
}

// Error describes the wrapped error.
func (e *ExchangeError) Error() string {
	return fmt.Sprintf("node agent %s: %v", e.Op, e.Err)
}

// Unwrap returns the wrapped error.
func (e *ExchangeError) Unwrap() error { return e.Err }

// Limits on what the plugin reads back from the agent.
const (
	maxResponseBody   = MaxRequestBytes
	maxResponseHeader = 16 << 10
)

// PodEvent sends ev and returns the agent's answer. A non-nil response may
// carry an agent-side error in its Error field.
func (c *Client) PodEvent(ctx context.Context, ev *PodEvent) (*PodEventResponse, error) {
	body, err := json.Marshal(ev)
	if err != nil {
		return nil, fmt.Errorf("encode pod event: %w", err)
	}
	return c.exchange(ctx, "POST", PathPodEvent, body)
}

// Status asks whether the agent is up and serving.
func (c *Client) Status(ctx context.Context) error {
	resp, err := c.exchange(ctx, "GET", PathStatus, nil)
	if err != nil {
		return err
	}
	if resp.Error != "" {
		return errors.New(resp.Error)
	}
	return nil
}

// GC sends the runtime's list of valid attachments.
func (c *Client) GC(ctx context.Context, req *GCRequest) (*PodEventResponse, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, fmt.Errorf("encode gc request: %w", err)
	}
	return c.exchange(ctx, "POST", PathGC, body)
}

// PluginLog sends the plugin's log records of one call to the agent.
func (c *Client) PluginLog(ctx context.Context, l *PluginLog) error {
	body, err := json.Marshal(l)
	if err != nil {
		return fmt.Errorf("encode plugin log: %w", err)
	}
	resp, err := c.exchange(ctx, "POST", PathPluginLog, body)
	if err != nil {
		return err
	}
	if resp.Error != "" {
		return errors.New(resp.Error)
	}
	return nil
}

func (c *Client) exchange(ctx context.Context, method, path string, body []byte) (*PodEventResponse, error) {
	conn, err := dialUnix(ctx, c.Socket)
	if err != nil {
		return nil, &UnreachableError{Socket: c.Socket, Err: err}
	}
	defer conn.Close()

	if _, err := conn.Write(encodeRequest(method, path, body)); err != nil {
		return nil, &ExchangeError{Op: method + " " + path, Err: err}
	}
	status, respBody, err := ReadResponse(bufio.NewReaderSize(conn, 4096))
	if err != nil {
		return nil, &ExchangeError{Op: method + " " + path, Err: err}
	}
	var resp PodEventResponse
	if err := json.Unmarshal(respBody, &resp); err != nil {
		return nil, &ExchangeError{Op: method + " " + path, Err: fmt.Errorf("HTTP %d with undecodable body: %w", status, err)}
	}
	resp.Status = status
	if status != 200 && resp.Error == "" {
		resp.Error = fmt.Sprintf("agent answered HTTP %d", status)
		resp.Verdict = ""
	}
	if status == 200 && resp.Error == "" && resp.Verdict == "" {
		return nil, &ExchangeError{Op: method + " " + path, Err: errors.New("answer has neither verdict nor error")}
	}
	return &resp, nil
}

func encodeRequest(method, path string, body []byte) []byte {
	var b bytes.Buffer
	b.Grow(128 + len(body))
	fmt.Fprintf(&b, "%s %s HTTP/1.0\r\nHost: ambient-cni-agent\r\n", method, path)
	if body != nil {
		fmt.Fprintf(&b, "Content-Type: application/json\r\nContent-Length: %d\r\n", len(body))
	}
	b.WriteString("\r\n")
	b.Write(body)
	return b.Bytes()
}

// ReadResponse parses an HTTP/1.x response: status line, headers and a
// body delimited by Content-Length or by the end of the connection. It
// rejects chunked encoding and anything larger than the agent ever sends.
func ReadResponse(r *bufio.Reader) (status int, body []byte, err error) {
	var headerBytes int
	line, err := readLine(r, &headerBytes)
	if err != nil {
		return 0, nil, fmt.Errorf("read status line: %w", err)
	}
	proto, rest, ok := strings.Cut(line, " ")
	if !ok || (proto != "HTTP/1.0" && proto != "HTTP/1.1") {
		return 0, nil, fmt.Errorf("malformed status line %q", truncate(line))
	}
	code, _, _ := strings.Cut(rest, " ")
	status, err = strconv.Atoi(code)
	if err != nil || len(code) != 3 || status < 100 {
		return 0, nil, fmt.Errorf("malformed status code in %q", truncate(line))
	}
	length := int64(-1)
	for {
		line, err := readLine(r, &headerBytes)
		if err != nil {
			return 0, nil, fmt.Errorf("read header: %w", err)
		}
		if line == "" {
			break
		}
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			return 0, nil, fmt.Errorf("malformed header line %q", truncate(line))
		}
		v = strings.TrimSpace(v)
		switch strings.ToLower(strings.TrimSpace(k)) {
		case "content-length":
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 || (length >= 0 && n != length) {
				return 0, nil, fmt.Errorf("bad Content-Length %q", truncate(v))
			}
			length = n
		case "transfer-encoding":
			if !strings.EqualFold(v, "identity") {
				return 0, nil, fmt.Errorf("unsupported Transfer-Encoding %q", truncate(v))
			}
		}
	}
	if length > maxResponseBody {
		return 0, nil, fmt.Errorf("body of %d bytes exceeds %d", length, maxResponseBody)
	}
	if length >= 0 {
		body = make([]byte, length)
		if _, err := io.ReadFull(r, body); err != nil {
			return 0, nil, fmt.Errorf("read body: %w", err)
		}
		return status, body, nil
	}
	body, err = io.ReadAll(io.LimitReader(r, maxResponseBody+1))
	if err != nil {
		return 0, nil, fmt.Errorf("read body: %w", err)
	}
	if len(body) > maxResponseBody {
		return 0, nil, fmt.Errorf("body exceeds %d bytes", maxResponseBody)
	}
	return status, body, nil
}

// readLine reads one CRLF- or LF-terminated line, charging it against the
// header budget.
func readLine(r *bufio.Reader, used *int) (string, error) {
	var line []byte
	for {
		chunk, isPrefix, err := r.ReadLine()
		if err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			return "", err
		}
		*used += len(chunk) + 2
		if *used > maxResponseHeader {
			return "", fmt.Errorf("header exceeds %d bytes", maxResponseHeader)
		}
		line = append(line, chunk...)
		if !isPrefix {
			return string(line), nil
		}
	}
}

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
