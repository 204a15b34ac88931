package ambient

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"time"
)

// Plugin → agent wire contract: HTTP+JSON over a root-only Unix socket.
const (
	// PathPodEvent is the HTTP path the plugin POSTs a PodEvent to.
	PathPodEvent = "/v1/pod-event"
	// PathStatus is the HTTP path the plugin GETs for CNI STATUS.
	PathStatus = "/v1/status"
	// PathGC is the HTTP path the plugin POSTs a GCRequest to.
	PathGC = "/v1/gc"
	// MaxRequestBytes caps every request body the agent accepts.
	MaxRequestBytes = 64 << 10
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
}

// GCRequest lists the attachments the runtime still considers valid.
type GCRequest struct {
	ValidSandboxIDs []string `json:"validSandboxIDs"`
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

// EnablementSnapshot is what the agent writes next to its socket so the
// plugin can decide when the agent is unreachable.
type EnablementSnapshot struct {
	// Generation increases with every write.
	Generation int64 `json:"generation"`
	// EnabledNamespaces are namespaces labelled ambient.
	EnabledNamespaces []string `json:"enabledNamespaces"`
	// PodLevelEnablement is true when some pod outside an enabled namespace
	// carries the ambient label, so any namespace may hold a captured pod.
	PodLevelEnablement bool `json:"podLevelEnablement"`
	// ExcludedNamespaces are never captured.
	ExcludedNamespaces []string `json:"excludedNamespaces"`
	// Written is when the agent wrote the snapshot.
	Written time.Time `json:"written"`
}

// ErrNoSnapshot is returned by ParseSnapshot for empty input.
var ErrNoSnapshot = errors.New("empty enablement snapshot")

// maxSnapshotBytes bounds the snapshot file the plugin will read.
const maxSnapshotBytes = 4 << 20

// ParseSnapshot decodes and sanity-checks a snapshot file's contents.
func ParseSnapshot(b []byte) (*EnablementSnapshot, error) {
	if len(b) == 0 {
		return nil, ErrNoSnapshot
	}
	if len(b) > maxSnapshotBytes {
		return nil, fmt.Errorf("enablement snapshot is %d bytes, more than %d", len(b), maxSnapshotBytes)
	}
	var s EnablementSnapshot
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("decode enablement snapshot: %w", err)
	}
	if s.Generation <= 0 {
		return nil, fmt.Errorf("enablement snapshot: generation %d is not positive", s.Generation)
	}
	return &s, nil
}

// MayNeedCapture is the plugin's fallback rule when the agent is down: a
// pod in namespace ns may need capture unless ns is excluded, or ns is not
// enabled and no pod-level enablement is in use anywhere. A nil snapshot
// (missing or unreadable) means "may need capture": fail closed.
func (s *EnablementSnapshot) MayNeedCapture(ns string) bool {
	if s == nil {
		return true
	}
	if slices.Contains(s.ExcludedNamespaces, ns) {
		return false
	}
	return s.PodLevelEnablement || slices.Contains(s.EnabledNamespaces, ns)
}
