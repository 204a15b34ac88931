// Package kubectlplugin is `kubectl ambient-cni`: it finds the node agent
// of a pod's node (the chart's DaemonSet pod there), asks it through the API
// server's pods/exec subresource for its explain report (what
// `install-cni debug explain` prints), and renders the answer for people:
// the verdict, what was checked, and what to do.
//
// The report is read into the types below, which mirror the JSON of
// pkg/explain rather than import it: pkg/explain links the agent's Linux
// netns code, and the plugin runs on operators' machines of any OS. A test
// keeps the two in step.
package kubectlplugin

import (
	"encoding/json"
	"time"
)

// Report is the part of the agent's per-pod report (pkg/explain.Report)
// the plugin renders.
type Report struct {
	Pod         string    `json:"pod"`
	UID         string    `json:"uid,omitempty"`
	Phase       string    `json:"phase,omitempty"`
	Terminating bool      `json:"terminating,omitempty"`
	IPs         []string  `json:"ips,omitempty"`
	Verdict     string    `json:"verdict"`
	OK          bool      `json:"ok"`
	Problems    []string  `json:"problems,omitempty"`
	Policy      Policy    `json:"policy"`
	Captured    *Captured `json:"captured,omitempty"`
	Netns       Netns     `json:"netns"`
	Annotation  string    `json:"annotation"`
}

// Policy is the enablement decision.
type Policy struct {
	Capture        bool   `json:"capture"`
	Reason         string `json:"reason"`
	PodLabel       string `json:"podLabel,omitempty"`
	NamespaceLabel string `json:"namespaceLabel,omitempty"`
	Selector       int    `json:"selector,omitempty"`
	Note           string `json:"note,omitempty"`
}

// Captured is the agent's state for a pod it holds.
type Captured struct {
	State        string        `json:"state"`
	ZtunnelAcked bool          `json:"ztunnelAcked"`
	Via          string        `json:"via"`
	SandboxID    string        `json:"sandboxID,omitempty"`
	Since        time.Time     `json:"since"`
	Rules        Rules         `json:"rules"`
	Verification *Verification `json:"verification,omitempty"`
}

// Rules is the result of verifying the pod's rules when the agent answered.
type Rules struct {
	Backend        string   `json:"backend,omitempty"`
	Clean          bool     `json:"clean"`
	Drift          []string `json:"drift,omitempty"`
	Error          string   `json:"error,omitempty"`
	DNSCapture     bool     `json:"dnsCapture"`
	InboundCapture bool     `json:"inboundCapture"`
}

// Verification is the verifier's last proof of the pod.
type Verification struct {
	At      time.Time `json:"at"`
	Proven  bool      `json:"proven"`
	Problem string    `json:"problem,omitempty"`
}

// Netns says whether the pod's network namespace was found.
type Netns struct {
	Found bool   `json:"found"`
	How   string `json:"how"`
	Path  string `json:"path,omitempty"`
	Inode uint64 `json:"inode,omitempty"`
}

// NodeReport is the part of the agent's node report
// (pkg/explain.NodeReport) the plugin renders.
type NodeReport struct {
	RulesBackend       string    `json:"rulesBackend,omitempty"`
	ZtunnelConnections *int      `json:"ztunnelConnections,omitempty"`
	ReleaseSignal      string    `json:"releaseSignal,omitempty"`
	Pods               int       `json:"pods"`
	Captured           int       `json:"captured"`
	WithProblems       int       `json:"withProblems"`
	Reports            []*Report `json:"reports"`
}

// Agent names the node agent that answered.
type Agent struct {
	Node      string `json:"node"`
	Namespace string `json:"namespace"`
	Pod       string `json:"pod"`
}

// PodAnswer is `explain NS/POD`: the agent asked and its report. With
// -o json it is printed as is; Report holds the agent's JSON unchanged.
type PodAnswer struct {
	Agent  Agent           `json:"agent"`
	Report json.RawMessage `json:"report"`
}

// NodeAnswer is `status NODE`: the agent, its readiness (the readiness
// probe's own check, run now) and its node report.
type NodeAnswer struct {
	Agent Agent `json:"agent"`
	Ready bool  `json:"ready"`
	// Readiness is what the readiness check printed (what fails, when not
	// ready).
	Readiness string          `json:"readiness,omitempty"`
	Report    json.RawMessage `json:"report"`
}
