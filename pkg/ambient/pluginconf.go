package ambient

import (
	"strings"
	"time"
)

// PluginConf is ambient-cni's own keys in its entry of the primary
// conflist: the installer writes it (its "type" is the plugin name, which
// the installer adds) and the plugin reads it back beside the standard CNI
// keys. Empty or absent keys take the defaults below.
type PluginConf struct {
	// AgentSocket is the node agent's Unix socket (default
	// DefaultAgentSocket).
	AgentSocket string `json:"agentSocket,omitempty"`
	// StateDir is the agent's persistent node directory (default
	// DefaultStateDir).
	StateDir string `json:"stateDir,omitempty"`
	// Timeout bounds one exchange with the agent, as a Go duration
	// (default DefaultPluginTimeout, at most MaxPluginTimeout).
	Timeout string `json:"timeout,omitempty"`
	// LogLevel filters the plugin's log on the runtime's stderr: debug,
	// info, warn or error (default DefaultPluginLogLevel).
	LogLevel string `json:"logLevel,omitempty"`
	// ExcludedNamespaces pass through without asking the agent. Absent (or
	// null) means DefaultExcludedNamespace; an empty list excludes none.
	ExcludedNamespaces []string `json:"excludedNamespaces"`
	// ControlPlaneNamespaces never wait on the agent: while it cannot
	// answer, their pods are decided by the API server and, failing that,
	// pass unless the agent's snapshot shows their namespace enabled. An
	// entry ending in "*" is a prefix ("openshift-*").
	ControlPlaneNamespaces []string `json:"controlPlaneNamespaces,omitempty"`
	// StatusRequiresAgent makes CNI STATUS fail while the agent is
	// unreachable (a failing STATUS marks the whole node NotReady).
	StatusRequiresAgent bool `json:"statusRequiresAgent,omitempty"`
	// AgentUnreachable is what ADD and CHECK do for a pod outside the
	// excluded namespaces while the agent cannot answer:
	// AgentUnreachableSnapshot (default) or AgentUnreachableFailClosed.
	AgentUnreachable string `json:"agentUnreachable,omitempty"`
	// AgentDownAfter is accepted for existing configurations; no decision
	// uses it any more.
	AgentDownAfter string `json:"agentDownAfter,omitempty"`
	// IstioCNIRunDir, set by an agent that takes over from istio-cni, is
	// istio-cni's run directory (cni_agent_run_dir): while the agent cannot
	// answer and istio-cni's node agent answers there (the node given back
	// to istio-cni with ours broken), the plugin lets istio-cni's plugin,
	// chained after it, decide the pod.
	IstioCNIRunDir string `json:"istioCNIRunDir,omitempty"`
	// IstioCNIConfDir, written with IstioCNIRunDir, is the host's CNI
	// config directory: the plugin lets istio-cni's plugin decide a pod
	// only once istio-cni's entry has been in the network's chain there
	// for a while, as istio-cni's agent answers before its installer
	// chains its plugin.
	IstioCNIConfDir string `json:"istioCNIConfDir,omitempty"`
}

// Values of PluginConf.AgentUnreachable.
const (
	// AgentUnreachableFailClosed fails ADD with CNI error 11 (try again
	// later) for every pod outside the excluded namespaces while the agent
	// cannot answer: a strict opt-in.
	AgentUnreachableFailClosed = "fail-closed"
	// AgentUnreachableSnapshot (the default, named for its last tier)
	// decides while the agent cannot answer: by the API server, asked with
	// the plugin's own credential; failing that, by the agent's snapshot in
	// its state directory, failing closed for what it cannot vouch for (see
	// package plugin).
	AgentUnreachableSnapshot = "snapshot"
)

// Defaults and bounds of PluginConf.
const (
	// DefaultPluginTimeout is how long the plugin waits for the agent.
	DefaultPluginTimeout = 30 * time.Second
	// MaxPluginTimeout bounds Timeout: kubelet's own runtime request
	// timeout is two minutes, waiting longer only hides a stuck agent.
	MaxPluginTimeout = 2 * time.Minute
	// DefaultAgentDownAfter is how long the plugin expects an agent that
	// stopped answering to come back (AgentDownAfter's default): longer
	// than a restart or an upgrade of the DaemonSet takes.
	DefaultAgentDownAfter = 2 * time.Minute
	// MaxAgentDownAfter bounds AgentDownAfter.
	MaxAgentDownAfter = 24 * time.Hour
	// DefaultPluginLogLevel is the plugin's default log level.
	DefaultPluginLogLevel = "warn"
	// handlerMargin is how much sooner than the plugin's timeout the agent
	// gives up on a request: long enough for its answer to travel back.
	handlerMargin = time.Second
)

// HandlerTimeout is the agent's deadline for one plugin request when the
// plugin waits pluginTimeout: a margin short of it, so the plugin reads
// the agent's answer (a retryable error, say) instead of timing out
// itself. Very short timeouts keep at least half.
func HandlerTimeout(pluginTimeout time.Duration) time.Duration {
	return max(pluginTimeout-handlerMargin, pluginTimeout/2)
}

// InNamespaces reports whether ns is one of namespaces, where an entry
// ending in "*" is a prefix ("openshift-*"): the form of
// ControlPlaneNamespaces, read alike by the plugin and the agent.
func InNamespaces(namespaces []string, ns string) bool {
	for _, e := range namespaces {
		if p, ok := strings.CutSuffix(e, "*"); ok && strings.HasPrefix(ns, p) || e == ns {
			return true
		}
	}
	return false
}
