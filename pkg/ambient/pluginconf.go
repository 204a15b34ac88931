package ambient

import "time"

// PluginConf is ambient-cni's own keys in its entry of the primary
// conflist: the installer writes it (its "type" is the plugin name, which
// the installer adds) and the plugin reads it back beside the standard CNI
// keys. Empty or absent keys take the defaults below.
type PluginConf struct {
	// AgentSocket is the node agent's Unix socket (default
	// DefaultAgentSocket).
	AgentSocket string `json:"agentSocket,omitempty"`
	// Timeout bounds one exchange with the agent, as a Go duration
	// (default DefaultPluginTimeout, at most MaxPluginTimeout).
	Timeout string `json:"timeout,omitempty"`
	// LogLevel filters the plugin's log on the runtime's stderr: debug,
	// info, warn or error (default DefaultPluginLogLevel).
	LogLevel string `json:"logLevel,omitempty"`
	// ExcludedNamespaces pass through without asking the agent. Absent (or
	// null) means DefaultExcludedNamespace; an empty list excludes none.
	ExcludedNamespaces []string `json:"excludedNamespaces"`
	// StatusRequiresAgent makes CNI STATUS fail while the agent is
	// unreachable (a failing STATUS marks the whole node NotReady).
	StatusRequiresAgent bool `json:"statusRequiresAgent,omitempty"`
	// AgentUnreachable is what ADD and CHECK do for a pod outside the
	// excluded namespaces while the agent cannot be reached:
	// AgentUnreachableFailClosed (default) or AgentUnreachableSnapshot.
	AgentUnreachable string `json:"agentUnreachable,omitempty"`
}

// Values of PluginConf.AgentUnreachable.
const (
	// AgentUnreachableFailClosed fails ADD with CNI error 11 (try again
	// later) for every pod outside the excluded namespaces while the agent
	// is unreachable: nothing the plugin can read proves that such a pod
	// needs no capture, since a namespace or pod label may have changed
	// while the agent was away.
	AgentUnreachableFailClosed = "fail-closed"
	// AgentUnreachableSnapshot decides from the agent's last enablement
	// snapshot instead: pods in namespaces it did not see enabled start
	// uncaptured (unless pod-level enablement was in use), even if the
	// namespace was labelled after the snapshot was written.
	AgentUnreachableSnapshot = "snapshot"
)

// Defaults and bounds of PluginConf.
const (
	// DefaultPluginTimeout is how long the plugin waits for the agent.
	DefaultPluginTimeout = 30 * time.Second
	// MaxPluginTimeout bounds Timeout: kubelet's own runtime request
	// timeout is two minutes, waiting longer only hides a stuck agent.
	MaxPluginTimeout = 2 * time.Minute
	// DefaultPluginLogLevel is the plugin's default log level.
	DefaultPluginLogLevel = "warn"
)
