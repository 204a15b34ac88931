package ambient

// Plugin → fallback binary wire contract. While the agent cannot answer,
// the plugin execs the fallback binary (ambient-cni-fallback, package
// fallback) with the state directory as its one argument, writes one
// FallbackRequest (JSON) to its stdin and reads one FallbackVerdict (JSON)
// from its stdout. Both binaries use these types, so the two sides cannot
// drift apart.

// MaxFallbackBytes bounds the request the fallback binary reads and the
// verdict the plugin reads.
const MaxFallbackBytes = 4096

// FallbackRequest names the pod the runtime is starting.
type FallbackRequest struct {
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
	// UID, when set, must be the pod's: another pod of the same name
	// (deleted and recreated) is not the one being started. Older
	// runtimes do not give it.
	UID string `json:"uid,omitempty"`
	// CheckAgent: the pod will wait for the node agent if it must be
	// captured, so the fallback checks that an agent can still come
	// (FallbackVerdict.AgentGone).
	CheckAgent bool `json:"checkAgent,omitempty"`
}

// FallbackVerdict is the fallback binary's answer.
type FallbackVerdict struct {
	// Enroll: the pod must be captured.
	Enroll bool `json:"enroll"`
	// Reason is the enablement reason (enablement.Reason).
	Reason string `json:"reason"`
	// AgentGone, set only for a pod that must be captured and a request
	// with CheckAgent, says why no agent will come back to this node: the
	// agent's DaemonSet is gone, being deleted, or no longer runs on the
	// node. Empty when it still does, or when that cannot be told.
	AgentGone string `json:"agentGone,omitempty"`
}
