// Package plugin is the logic of the thin CNI plugin: it parses the plugin
// configuration and the runtime's CNI_ARGS, forwards each pod to the node
// agent over its Unix socket, decides on its own when the agent cannot
// answer (by the API server through the fallback binary, else by the
// agent's persistent snapshot, failing closed for what it cannot vouch
// for), and passes prevResult through unchanged.
//
// It must stay small: the runtime execs the plugin for every pod, so it
// imports no Kubernetes client and no net/http or TLS (see the deps test):
// the API server is asked by a separate binary, exec'd only then.
package plugin

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// SupportedVersions are the CNI spec versions the plugin speaks.
var SupportedVersions = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

// rawConfig is the JSON the runtime hands the plugin on stdin: the
// standard CNI keys the plugin reads and ours. Other keys are ignored:
// runtimes inject their own (runtimeConfig, args, ...), and the keys meant
// for the runtime (type, capabilities, ipam, dns) are not the plugin's.
type rawConfig struct {
	CNIVersion       string               `json:"cniVersion"`
	Name             string               `json:"name"`
	ValidAttachments []types.GCAttachment `json:"cni.dev/valid-attachments,omitempty"`
	// PrevResult is kept as its bytes: decoded once, by its own version,
	// and printed as it came when that is the config's version.
	PrevResult json.RawMessage `json:"prevResult,omitempty"`
	ownConf
}

// ownConf names ambient.PluginConf so both confs can be embedded.
type ownConf = ambient.PluginConf

// Config is the parsed and validated plugin configuration.
type Config struct {
	// CNIVersion is the config's spec version; results are printed in it.
	CNIVersion string
	// Name is the network name.
	Name string
	// AgentSocket is the node agent's Unix socket (key "agentSocket").
	AgentSocket string
	// StateDir is the agent's persistent node directory (key "stateDir").
	StateDir string
	// SnapshotFile is the agent's enablement snapshot, next to the socket.
	SnapshotFile string
	// SpoolDir holds DELs recorded while the agent was unreachable.
	SpoolDir string
	// AddSpoolDir holds the ADDs let through while the agent was gone, for
	// it to re-check.
	AddSpoolDir string
	// HeartbeatFile is the agent's heartbeat, next to the socket.
	HeartbeatFile string
	// AgentDownAfter is how long after the agent's last sign of life the
	// snapshot fallback applies (key "agentDownAfter").
	AgentDownAfter time.Duration
	// Timeout bounds one exchange with the agent (key "timeout").
	Timeout time.Duration
	// LogLevel filters the plugin's stderr log (key "logLevel").
	LogLevel slog.Level
	// ExcludedNamespaces pass through without asking the agent
	// (key "excludedNamespaces"; default kube-system).
	ExcludedNamespaces []string
	// ControlPlaneNamespaces never wait on the agent (key
	// "controlPlaneNamespaces"; "prefix-*" entries match by prefix).
	ControlPlaneNamespaces []string
	// StatusRequiresAgent makes STATUS fail with code 50 while the agent is
	// unreachable (key "statusRequiresAgent"; default false, because a
	// failing STATUS marks the whole node NotReady).
	StatusRequiresAgent bool
	// AgentUnreachable is what ADD and CHECK do for a pod outside the
	// excluded namespaces while the agent is unreachable (key
	// "agentUnreachable"): ambient.AgentUnreachableSnapshot (default) or
	// ambient.AgentUnreachableFailClosed.
	AgentUnreachable string
	// IstioCNIRunDir is istio-cni's run directory (key "istioCNIRunDir";
	// empty: istio-cni is never asked about).
	IstioCNIRunDir string
	// IstioCNIConfDir is the host's CNI config directory, where the
	// network's chain must hold istio-cni's plugin before a pod goes to it
	// (key "istioCNIConfDir"; empty: never).
	IstioCNIConfDir string
	// PrevResult is the previous plugin's result, nil when absent.
	PrevResult *PrevResult
	// ValidAttachments is set for GC.
	ValidAttachments []types.GCAttachment
}

// maxConfigBytes bounds the stdin config; real ones are a few KiB.
const maxConfigBytes = 1 << 20

// ParseConfig decodes and validates the stdin configuration. The returned
// error is a *types.Error with a CNI error code.
func ParseConfig(stdin []byte) (*Config, error) {
	if len(stdin) > maxConfigBytes {
		return nil, types.NewError(types.ErrInvalidNetworkConfig, fmt.Sprintf("config is %d bytes, more than %d", len(stdin), maxConfigBytes), "")
	}
	var raw rawConfig
	if err := json.Unmarshal(stdin, &raw); err != nil {
		return nil, types.NewError(types.ErrDecodingFailure, "decode ambient-cni config: "+err.Error(), "")
	}
	return configFrom(&raw)
}

// configFrom validates a decoded configuration.
func configFrom(raw *rawConfig) (*Config, error) {
	if !slices.Contains(SupportedVersions, raw.CNIVersion) {
		return nil, types.NewError(types.ErrIncompatibleCNIVersion,
			fmt.Sprintf("cniVersion %q is not supported", raw.CNIVersion),
			"supported: "+strings.Join(SupportedVersions, ", "))
	}
	c := &Config{
		CNIVersion:          raw.CNIVersion,
		Name:                raw.Name,
		AgentSocket:         raw.AgentSocket,
		Timeout:             ambient.DefaultPluginTimeout,
		AgentDownAfter:      ambient.DefaultAgentDownAfter,
		ExcludedNamespaces:  []string{ambient.DefaultExcludedNamespace},
		StatusRequiresAgent: raw.StatusRequiresAgent,
		AgentUnreachable:    raw.AgentUnreachable,
		ValidAttachments:    raw.ValidAttachments,
	}
	switch c.AgentUnreachable {
	case "":
		c.AgentUnreachable = ambient.AgentUnreachableSnapshot
	case ambient.AgentUnreachableFailClosed, ambient.AgentUnreachableSnapshot:
	default:
		return nil, invalidConfig("agentUnreachable %q must be %q or %q", raw.AgentUnreachable, ambient.AgentUnreachableFailClosed, ambient.AgentUnreachableSnapshot)
	}
	if c.AgentSocket == "" {
		c.AgentSocket = ambient.DefaultAgentSocket
	}
	if !filepath.IsAbs(c.AgentSocket) || filepath.Clean(c.AgentSocket) != c.AgentSocket || len(c.AgentSocket) > 107 {
		// 107: sun_path holds 108 bytes including the terminating NUL.
		return nil, invalidConfig("agentSocket %q must be a clean absolute path of at most 107 bytes", c.AgentSocket)
	}
	if d := raw.IstioCNIRunDir; d != "" {
		if !filepath.IsAbs(d) || filepath.Clean(d) != d || len(filepath.Join(d, ambient.IstioCNIEventSocket)) > 107 {
			return nil, invalidConfig("istioCNIRunDir %q must be a clean absolute path whose %s fits in 107 bytes", d, ambient.IstioCNIEventSocket)
		}
		c.IstioCNIRunDir = d
	}
	if d := raw.IstioCNIConfDir; d != "" {
		if !filepath.IsAbs(d) || filepath.Clean(d) != d {
			return nil, invalidConfig("istioCNIConfDir %q must be a clean absolute path", d)
		}
		c.IstioCNIConfDir = d
	}
	if raw.StateDir != "" && (!filepath.IsAbs(raw.StateDir) || filepath.Clean(raw.StateDir) != raw.StateDir) {
		return nil, invalidConfig("stateDir %q must be a clean absolute path", raw.StateDir)
	}
	files := nodefiles.ForSocket(c.AgentSocket).WithStateDir(raw.StateDir)
	c.StateDir = files.StateDir()
	c.SnapshotFile = files.Snapshot()
	c.SpoolDir = files.DelSpool()
	c.AddSpoolDir = files.AddSpool()
	c.HeartbeatFile = files.Heartbeat()
	if raw.AgentDownAfter != "" {
		d, err := time.ParseDuration(raw.AgentDownAfter)
		if err != nil || d <= 0 || d > ambient.MaxAgentDownAfter {
			return nil, invalidConfig("agentDownAfter %q must be a Go duration in (0, %s]", raw.AgentDownAfter, ambient.MaxAgentDownAfter)
		}
		c.AgentDownAfter = d
	}
	if raw.Timeout != "" {
		d, err := time.ParseDuration(raw.Timeout)
		if err != nil || d <= 0 || d > ambient.MaxPluginTimeout {
			return nil, invalidConfig("timeout %q must be a Go duration in (0, %s]", raw.Timeout, ambient.MaxPluginTimeout)
		}
		c.Timeout = d
	}
	lvl := raw.LogLevel
	if lvl == "" {
		lvl = ambient.DefaultPluginLogLevel
	}
	if err := c.LogLevel.UnmarshalText([]byte(lvl)); err != nil {
		return nil, invalidConfig("logLevel %q must be debug, info, warn or error", raw.LogLevel)
	}
	for _, ns := range raw.ControlPlaneNamespaces {
		if p, ok := strings.CutSuffix(ns, "*"); ok && !validNamespace(strings.TrimRight(p, "-")) || !ok && !validNamespace(ns) {
			return nil, invalidConfig("controlPlaneNamespaces: %q is not a namespace name or a prefix ending in *", ns)
		}
	}
	c.ControlPlaneNamespaces = raw.ControlPlaneNamespaces
	if raw.ExcludedNamespaces != nil {
		c.ExcludedNamespaces = raw.ExcludedNamespaces
		for _, ns := range c.ExcludedNamespaces {
			if !validNamespace(ns) {
				return nil, invalidConfig("excludedNamespaces: %q is not a valid namespace name", ns)
			}
		}
	}
	prev, err := parsePrevResult(raw.PrevResult, c.CNIVersion)
	if err != nil {
		return nil, err
	}
	c.PrevResult = prev
	return c, nil
}

// files is the layout of the agent's node files the config names.
func (c *Config) files() nodefiles.Layout {
	return nodefiles.ForSocket(c.AgentSocket).WithStateDir(c.StateDir)
}

// controlPlane reports whether ns is one of the control plane's
// namespaces, which never wait on the agent.
func (c *Config) controlPlane(ns string) bool {
	return ambient.InNamespaces(c.ControlPlaneNamespaces, ns)
}

func invalidConfig(format string, a ...any) error {
	return types.NewError(types.ErrInvalidNetworkConfig, "ambient-cni config: "+fmt.Sprintf(format, a...), "")
}

// validNamespace checks a DNS-1123 label, the form of namespace names.
func validNamespace(s string) bool {
	if s == "" || len(s) > 63 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}
