// Package kubectlplugin is `kubectl ambient-cni`: it finds the node agent
// of a pod's node (the chart's DaemonSet pod there), asks it through the API
// server's pods/exec subresource for its explain report (what
// `install-cni debug explain` prints), and renders the answer for people:
// the verdict, what was checked, and what to do.
//
// The report is read into the agent's own wire types
// (pkg/ambient/explainwire), which need only the standard library: the
// plugin runs on operators' machines of any OS.
package kubectlplugin

import "encoding/json"

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
