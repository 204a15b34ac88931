package plugin

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
)

// fallbackTimeout bounds the fallback binary: two GETs to the API server.
// It runs after the agent's own deadline, inside the runtime's.
const fallbackTimeout = 8 * time.Second

// askAPIServer runs the fallback binary the agent keeps in its state
// directory: it asks the API server about the pod with the plugin's own
// credential and decides with the agent's policy. It is a binary of its
// own so the plugin, exec'd for every pod, links no TLS or HTTP stack.
// Any failure (no binary, no credential, API server down, a timeout, a
// bad answer) is an error: the caller decides without the API server.
// With checkAgent (the caller makes a pod that must be captured wait for
// the agent) the binary also tells whether an agent can still come.
func (p *Plugin) askAPIServer(c *call, ev *ambient.PodEvent, checkAgent bool) (ambient.FallbackVerdict, error) {
	bin := c.cfg.files().FallbackBinary()
	if err := ownedByUs(bin); err != nil {
		return ambient.FallbackVerdict{}, err
	}
	req, err := json.Marshal(ambient.FallbackRequest{Namespace: ev.PodNamespace, Name: ev.PodName, UID: ev.PodUID, CheckAgent: checkAgent})
	if err != nil {
		return ambient.FallbackVerdict{}, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), fallbackTimeout)
	defer cancel()
	out, err := runFallback(ctx, bin, []string{bin, c.cfg.files().StateDir()}, req)
	if err != nil {
		return ambient.FallbackVerdict{}, err
	}
	return parseVerdict(out)
}

// parseVerdict reads the fallback binary's answer: one JSON object with
// enroll set, nothing unknown, nothing after it.
func parseVerdict(out []byte) (ambient.FallbackVerdict, error) {
	var v struct {
		ambient.FallbackVerdict
		// Enroll shadows the contract's field, so an answer without it
		// is told from one with enroll false.
		Enroll *bool `json:"enroll"`
	}
	dec := json.NewDecoder(bytes.NewReader(out))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&v); err != nil || v.Enroll == nil {
		return ambient.FallbackVerdict{}, fmt.Errorf("fallback binary: bad answer %q", truncate(out))
	}
	if dec.More() {
		return ambient.FallbackVerdict{}, fmt.Errorf("fallback binary: more than one answer %q", truncate(out))
	}
	v.FallbackVerdict.Enroll = *v.Enroll
	return v.FallbackVerdict, nil
}

// ownedByUs refuses a fallback binary anyone but us could have written.
func ownedByUs(path string) error {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return fmt.Errorf("fallback binary: %w", &os.PathError{Op: "stat", Path: path, Err: err})
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFREG || st.Mode&0o022 != 0 || int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("fallback binary %s: not a regular file written only by us", path)
	}
	return nil
}

// runFallback execs bin with argv, stdin in, and returns its stdout; it kills the
// process when ctx ends. The plugin avoids os/exec, as it does any package
// it needs only here.
func runFallback(ctx context.Context, bin string, argv []string, in []byte) ([]byte, error) {
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, err
	}
	errR, errW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		outR.Close()
		outW.Close()
		return nil, err
	}
	proc, err := os.StartProcess(bin, argv, &os.ProcAttr{Files: []*os.File{inR, outW, errW}, Env: []string{}})
	inR.Close()
	outW.Close()
	errW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		errR.Close()
		return nil, fmt.Errorf("fallback binary: %w", err)
	}
	// A process left holding the pipes (a child of the binary) cannot make
	// the reads outlast the deadline.
	if dl, ok := ctx.Deadline(); ok {
		_ = outR.SetReadDeadline(dl)
		_ = errR.SetReadDeadline(dl)
	}
	done := make(chan struct{})
	go func() {
		select {
		case <-ctx.Done():
			_ = proc.Kill()
		case <-done:
		}
	}()
	// The request is small: it fits the pipe, so this does not block.
	_, _ = inW.Write(in)
	inW.Close()
	type read struct {
		b   []byte
		err error
	}
	errc := make(chan read, 1)
	go func() {
		b, err := io.ReadAll(io.LimitReader(errR, ambient.MaxFallbackBytes))
		_, _ = io.Copy(io.Discard, errR)
		errc <- read{b, err}
	}()
	out, rerr := io.ReadAll(io.LimitReader(outR, ambient.MaxFallbackBytes+1))
	_, _ = io.Copy(io.Discard, outR)
	outR.Close()
	stderr := <-errc
	errR.Close()
	st, werr := proc.Wait()
	close(done)
	switch {
	case ctx.Err() != nil:
		return nil, fmt.Errorf("fallback binary: no answer within %s", fallbackTimeout)
	case werr != nil:
		return nil, fmt.Errorf("fallback binary: %w", werr)
	case !st.Success():
		return nil, fmt.Errorf("fallback binary: %s: %s", st, strings.TrimSpace(truncate(stderr.b)))
	case rerr != nil:
		return nil, fmt.Errorf("fallback binary: %w", rerr)
	case len(out) > ambient.MaxFallbackBytes:
		return nil, errors.New("fallback binary: answer too long")
	}
	return out, nil
}

func truncate(b []byte) string {
	if len(b) > 200 {
		b = b[:200]
	}
	return string(b)
}
