package nodefiles

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
)

// EnablementSnapshot is what the agent writes next to its socket so the
// plugin can decide when the agent is unreachable.
type EnablementSnapshot struct {
	// Generation increases with every write.
	Generation int64 `json:"generation"`
	// EnabledNamespaces are namespaces where a pod may be enabled whatever
	// its own labels: the enablement selectors select the namespace
	// (labelled ambient, by Istio's default list).
	EnabledNamespaces []string `json:"enabledNamespaces"`
	// PodLevelEnablement is true when some pod outside an enabled namespace
	// is enabled by its own labels alone (by default, the ambient label), so
	// any namespace may hold a captured pod. The plugin decides by the
	// pods listed captured and the enabled namespaces; this is for people
	// reading the file.
	PodLevelEnablement bool `json:"podLevelEnablement"`
	// ExcludedNamespaces are never captured.
	ExcludedNamespaces []string `json:"excludedNamespaces"`
	// Namespaces are every namespace the agent knew when it wrote: one it
	// never saw may be enabled, so the plugin fails closed for it.
	Namespaces []string `json:"namespaces,omitempty"`
	// Pods are this node's pods the agent knew, by UID, with its decision
	// (true: captured). A pod restarted after a reboot keeps its UID.
	Pods map[string]bool `json:"pods,omitempty"`
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

// ReadSnapshot reads and parses the snapshot file at path.
func ReadSnapshot(path string) (*EnablementSnapshot, error) {
	// O_NONBLOCK: the plugin reads this while pods wait; a FIFO in its
	// place must fail the regular-file check, not block the open.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s: not a regular file", path)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxSnapshotBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", path, err)
	}
	s, err := ParseSnapshot(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

// WriteSnapshot writes s to path atomically, mode 0600, creating the
// directory (0700) if needed.
func WriteSnapshot(path string, s *EnablementSnapshot) error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return fmt.Errorf("encode enablement snapshot: %w", err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("create snapshot dir: %w", err)
	}
	if err := atomicfile.WriteFile(path, b, atomicfile.Options{Mode: 0o600}); err != nil {
		return fmt.Errorf("enablement snapshot: %w", err)
	}
	return nil
}
