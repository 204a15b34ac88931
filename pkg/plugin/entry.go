package plugin

// Entry is the plugin's entry in the primary conflist, as the installer
// writes it. Its JSON keys are the ones ParseConfig reads; a test keeps the
// two in step.
type Entry struct {
	Type                string   `json:"type"`
	AgentSocket         string   `json:"agentSocket,omitempty"`
	Timeout             string   `json:"timeout,omitempty"`
	LogLevel            string   `json:"logLevel,omitempty"`
	ExcludedNamespaces  []string `json:"excludedNamespaces"`
	StatusRequiresAgent bool     `json:"statusRequiresAgent,omitempty"`
}
