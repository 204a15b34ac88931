package ambient

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
)

// Plugin → agent wire contract: HTTP+JSON over a root-only Unix socket.
const (
	// PathPodEvent is the HTTP path the plugin POSTs a PodEvent to.
	PathPodEvent = "/v1/pod-event"
	// PathStatus is the HTTP path the plugin GETs for CNI STATUS.
	PathStatus = "/v1/status"
	// PathGC is the HTTP path the plugin POSTs a GCRequest to.
	PathGC = "/v1/gc"
	// PathPluginLog is the HTTP path the plugin POSTs its own log records
	// of one call to (PluginLog), so the agent's log shows them too.
	PathPluginLog = "/v1/plugin-log"
	// MaxPluginLogRecords bounds the records of one PluginLog; the plugin
	// keeps the first ones.
	MaxPluginLogRecords = 32
	// maxPluginLogText bounds a record's message and each attribute.
	maxPluginLogText = 1024
	// maxPluginLogAttrs bounds a record's attribute strings (key, value, ...).
	maxPluginLogAttrs = 32
	// MaxRequestBytes caps every request body the agent accepts.
	MaxRequestBytes = 64 << 10
	// maxGCIDs bounds a GC request (the body cap bounds it too).
	maxGCIDs = 4096
)

// Command is the CNI verb a PodEvent carries.
type Command string

// Commands the plugin forwards.
const (
	CommandAdd   Command = "ADD"
	CommandDel   Command = "DEL"
	CommandCheck Command = "CHECK"
)

// PodEvent is one plugin → agent request.
type PodEvent struct {
	Command      Command  `json:"command"`
	PodName      string   `json:"podName"`
	PodNamespace string   `json:"podNamespace"`
	PodUID       string   `json:"podUID"`
	SandboxID    string   `json:"sandboxID"`
	Netns        string   `json:"netns"`
	IfName       string   `json:"ifName,omitempty"`
	IPs          []string `json:"ips,omitempty"`
	// Network is the CNI network (the conflist's name) the sandbox is
	// attached through, so a GC of one network leaves the others' alone.
	Network string `json:"network,omitempty"`
}

// Verdict is the agent's answer to a successful PodEvent.
type Verdict string

// Verdicts the agent returns.
const (
	// VerdictEnrolled: rules are in place and ztunnel acked the pod.
	VerdictEnrolled Verdict = "enrolled"
	// VerdictNotEnrolled: the pod is not to be captured; pass through.
	VerdictNotEnrolled Verdict = "not-enrolled"
	// VerdictRemoved answers a DEL.
	VerdictRemoved Verdict = "removed"
	// VerdictOK answers a CHECK that found nothing wrong.
	VerdictOK Verdict = "ok"
)

// PodEventResponse is the agent's answer. Error is set (and Verdict empty)
// on failure; Retryable says whether the runtime should simply retry.
type PodEventResponse struct {
	Verdict   Verdict `json:"verdict,omitempty"`
	Error     string  `json:"error,omitempty"`
	Retryable bool    `json:"retryable,omitempty"`
	// Status is the HTTP status the answer came with (set by Client, not
	// on the wire): 400/413 the request was invalid, 409 a CHECK found a
	// mismatch, 503 retryable, 500 the agent failed.
	Status int `json:"-"`
}

// GCRequest lists the attachments the runtime still considers valid.
type GCRequest struct {
	ValidSandboxIDs []string `json:"validSandboxIDs"`
	// Network is the CNI network the GC is for: only sandboxes attached
	// through it are considered. Empty (an older plugin) considers all.
	Network string `json:"network,omitempty"`
}

// Field limits enforced by Validate; Kubernetes' own limits, rounded up.
const (
	maxNameLen  = 253
	maxUIDLen   = 128
	maxPathLen  = 4096
	maxIPs      = 16
	maxIfaceLen = 15
)

// Validate checks every field of a PodEvent and reports the first problem.
func (e *PodEvent) Validate() error {
	switch e.Command {
	case CommandAdd, CommandDel, CommandCheck:
	default:
		return fmt.Errorf("command %q: want ADD, DEL or CHECK", e.Command)
	}
	if err := validName("podName", e.PodName, e.Command != CommandDel); err != nil {
		return err
	}
	if err := validName("podNamespace", e.PodNamespace, e.Command != CommandDel); err != nil {
		return err
	}
	if len(e.PodUID) > maxUIDLen || !printable(e.PodUID) {
		return fmt.Errorf("podUID: invalid")
	}
	if e.SandboxID == "" || len(e.SandboxID) > maxNameLen || !printable(e.SandboxID) {
		return fmt.Errorf("sandboxID: required, at most %d printable characters", maxNameLen)
	}
	if len(e.Netns) > maxPathLen || !printable(e.Netns) {
		return fmt.Errorf("netns: invalid path")
	}
	if e.Command != CommandDel && e.Netns == "" {
		return fmt.Errorf("netns: required for %s", e.Command)
	}
	if len(e.IfName) > maxIfaceLen || !printable(e.IfName) {
		return fmt.Errorf("ifName: invalid")
	}
	if len(e.Network) > maxNameLen || !printable(e.Network) {
		return fmt.Errorf("network: at most %d printable characters", maxNameLen)
	}
	if len(e.IPs) > maxIPs {
		return fmt.Errorf("ips: at most %d", maxIPs)
	}
	for _, ip := range e.IPs {
		a, err := netip.ParseAddr(ip)
		if err != nil {
			return fmt.Errorf("ips: %w", err)
		}
		if a.Zone() != "" {
			return fmt.Errorf("ips: %q has a zone", ip)
		}
	}
	return nil
}

// Addrs returns the parsed pod IPs; call Validate first.
func (e *PodEvent) Addrs() []netip.Addr {
	out := make([]netip.Addr, 0, len(e.IPs))
	for _, s := range e.IPs {
		if a, err := netip.ParseAddr(s); err == nil {
			out = append(out, a.Unmap())
		}
	}
	return out
}

// validName checks a DNS-1123-ish Kubernetes object name.
func validName(field, v string, required bool) error {
	if v == "" {
		if required {
			return fmt.Errorf("%s: required", field)
		}
		return nil
	}
	if len(v) > maxNameLen {
		return fmt.Errorf("%s: longer than %d", field, maxNameLen)
	}
	for _, c := range v {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '.') {
			return fmt.Errorf("%s: %q is not a valid Kubernetes name", field, v)
		}
	}
	return nil
}

func printable(s string) bool {
	for _, c := range s {
		if c < 0x21 || c > 0x7e {
			return false
		}
	}
	return true
}

// PluginLog is the plugin's log records of one call, sent to the agent
// after the call, best effort: the same lines the runtime's log got.
type PluginLog struct {
	Records []PluginLogRecord `json:"records"`
}

// PluginLogRecord is one log record of the plugin.
type PluginLogRecord struct {
	// Level is slog's name of the level: DEBUG, INFO, WARN or ERROR.
	Level string `json:"level"`
	Msg   string `json:"msg"`
	// Attrs are the record's attributes as text: key, value, key, value.
	Attrs []string `json:"attrs,omitempty"`
}

// DecodePluginLog decodes and validates a plugin log body: at most
// MaxPluginLogRecords records, known levels, bounded text, pairs of
// attributes with printable keys.
func DecodePluginLog(b []byte) (*PluginLog, error) {
	var l PluginLog
	if err := decodeStrict(b, &l); err != nil {
		return nil, err
	}
	if len(l.Records) == 0 || len(l.Records) > MaxPluginLogRecords {
		return nil, fmt.Errorf("records: want 1 to %d, have %d", MaxPluginLogRecords, len(l.Records))
	}
	for i, r := range l.Records {
		switch r.Level {
		case "DEBUG", "INFO", "WARN", "ERROR":
		default:
			return nil, fmt.Errorf("records[%d].level: %q is not DEBUG, INFO, WARN or ERROR", i, r.Level)
		}
		if len(r.Msg) > maxPluginLogText {
			return nil, fmt.Errorf("records[%d].msg: longer than %d", i, maxPluginLogText)
		}
		if len(r.Attrs)%2 != 0 || len(r.Attrs) > maxPluginLogAttrs {
			return nil, fmt.Errorf("records[%d].attrs: want key, value pairs, at most %d strings", i, maxPluginLogAttrs)
		}
		for j, a := range r.Attrs {
			if len(a) > maxPluginLogText || (j%2 == 0 && (a == "" || !printable(a))) {
				return nil, fmt.Errorf("records[%d].attrs[%d]: invalid", i, j)
			}
		}
	}
	return &l, nil
}

// decodeStrict decodes exactly one JSON value with no unknown fields and
// nothing after it.
func decodeStrict(b []byte, v any) error {
	if len(b) > MaxRequestBytes {
		return fmt.Errorf("request body exceeds %d bytes", MaxRequestBytes)
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("decode request: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return errors.New("decode request: data after the JSON value")
	}
	return nil
}

// DecodePodEvent decodes and validates a pod event body: the agent takes
// requests only through it.
func DecodePodEvent(b []byte) (*PodEvent, error) {
	var ev PodEvent
	if err := decodeStrict(b, &ev); err != nil {
		return nil, err
	}
	if err := ev.Validate(); err != nil {
		return nil, fmt.Errorf("invalid pod event: %w", err)
	}
	return &ev, nil
}

// DecodeGCRequest decodes and validates a GC request body: the agent takes
// requests only through it.
func DecodeGCRequest(b []byte) (*GCRequest, error) {
	var req GCRequest
	if err := decodeStrict(b, &req); err != nil {
		return nil, err
	}
	if err := validateGC(&req); err != nil {
		return nil, err
	}
	return &req, nil
}

func validateGC(req *GCRequest) error {
	if req.ValidSandboxIDs == nil {
		return errors.New("validSandboxIDs: required (an empty list means none is valid)")
	}
	if len(req.Network) > maxNameLen || !printable(req.Network) {
		return fmt.Errorf("network: at most %d printable characters", maxNameLen)
	}
	if len(req.ValidSandboxIDs) > maxGCIDs {
		return fmt.Errorf("validSandboxIDs: at most %d", maxGCIDs)
	}
	for _, id := range req.ValidSandboxIDs {
		probe := PodEvent{Command: CommandDel, SandboxID: id}
		if err := probe.Validate(); err != nil {
			return fmt.Errorf("validSandboxIDs: %w", err)
		}
	}
	return nil
}
