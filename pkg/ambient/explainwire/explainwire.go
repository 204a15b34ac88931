// Package explainwire is the explain report's wire: what the node agent
// answers on its debug socket (pkg/explain builds it) and what
// `kubectl ambient-cni` reads and renders (pkg/kubectlplugin). Both sides
// use these types, so the two cannot drift apart. It needs only the
// standard library and builds for every OS the kubectl plugin ships for
// (the parent package's plugin client is Linux-only).
package explainwire

import "time"

// Report explains one pod.
type Report struct {
	// Pod is namespace/name.
	Pod   string `json:"pod"`
	UID   string `json:"uid,omitempty"`
	Phase string `json:"phase,omitempty"`
	// Terminating: the pod has a deletionTimestamp (it stays captured
	// until it is gone).
	Terminating bool     `json:"terminating,omitempty"`
	IPs         []string `json:"ips,omitempty"`
	// Verdict is the one-line answer; OK is false when something needs
	// attention, and Problems says what.
	Verdict  string   `json:"verdict"`
	OK       bool     `json:"ok"`
	Problems []string `json:"problems,omitempty"`
	Policy   Policy   `json:"policy"`
	// Captured is the agent's state for the pod; absent when the agent
	// does not hold it.
	Captured *Capture `json:"captured,omitempty"`
	Netns    Netns    `json:"netns"`
	// Annotation is the pod's ambient.istio.io/redirection as the agent's
	// cache sees it ("" when absent): what istiod reads.
	Annotation string `json:"annotation"`
}

// Policy is the enablement decision.
type Policy struct {
	Capture bool   `json:"capture"`
	Reason  string `json:"reason"`
	// PodLabel and NamespaceLabel are the istio.io/dataplane-mode labels.
	PodLabel       string `json:"podLabel,omitempty"`
	NamespaceLabel string `json:"namespaceLabel,omitempty"`
	// Selector is the 1-based index of the enablement selector entry that
	// enabled the pod (0, omitted, when none did).
	Selector int `json:"selector,omitempty"`
	// Note says what the decision did not follow, when that matters: a
	// data-plane label outside the data-plane namespaces.
	Note string `json:"note,omitempty"`
}

// Capture is the agent's state for a captured pod.
type Capture struct {
	// State is the redirection state: pending (rules in place, ztunnel
	// has not acknowledged) or enabled.
	State        string `json:"state"`
	ZtunnelAcked bool   `json:"ztunnelAcked"`
	// Via is "cni" (captured at its CNI ADD, SandboxID set) or
	// "controller" (captured while running).
	Via       string    `json:"via"`
	SandboxID string    `json:"sandboxID,omitempty"`
	Since     time.Time `json:"since"`
	Rules     Rules     `json:"rules"`
	// Verification is the verifier's last proof of the pod; absent
	// before the first (or with the verifier off).
	Verification *Verification `json:"verification,omitempty"`
}

// Verification is the outcome of the verifier's last proof of a pod.
type Verification struct {
	At time.Time `json:"at"`
	// Proven: the pod was proven captured (after any repair).
	Proven bool `json:"proven"`
	// Found is the drift the proof found (and repaired, when Repaired).
	Found    []string `json:"found,omitempty"`
	Repaired bool     `json:"repaired,omitempty"`
	// Problem says why the pod is not proven.
	Problem string `json:"problem,omitempty"`
	// LastDriftAt and LastDrift are the latest proof that found drift.
	LastDriftAt *time.Time `json:"lastDriftAt,omitempty"`
	LastDrift   []string   `json:"lastDrift,omitempty"`
}

// Rules is the result of verifying the pod's rules just now.
type Rules struct {
	Backend string `json:"backend,omitempty"`
	// Clean: the rules in the pod are exactly what the agent applied.
	Clean bool `json:"clean"`
	// Drift names each difference; Error says why they could not be read.
	Drift             []string `json:"drift,omitempty"`
	Error             string   `json:"error,omitempty"`
	DNSCapture        bool     `json:"dnsCapture"`
	InboundCapture    bool     `json:"inboundCapture"`
	VirtualInterfaces []string `json:"virtualInterfaces,omitempty"`
}

// Netns says whether the pod's network namespace was found.
type Netns struct {
	Found bool   `json:"found"`
	How   string `json:"how"`
	Path  string `json:"path,omitempty"`
	Inode uint64 `json:"inode,omitempty"`
}

// NodeReport explains every pod of the node.
type NodeReport struct {
	RulesBackend       string    `json:"rulesBackend,omitempty"`
	ZtunnelConnections *int      `json:"ztunnelConnections,omitempty"`
	ReleaseSignal      string    `json:"releaseSignal,omitempty"`
	Pods               int       `json:"pods"`
	Captured           int       `json:"captured"`
	WithProblems       int       `json:"withProblems"`
	Reports            []*Report `json:"reports"`
}
