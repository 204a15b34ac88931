package bench

import (
	"bytes"
	"io"
	"regexp"

	"github.com/ambient-cni/ambient-cni/pkg/agentconfig"
)

// Backend is one rules backend the benchmark runs the agent with.
type Backend struct {
	// Name is what the table calls it: "iptables" or "nftables".
	Name string
	// Selector is the install-cni setting (flag name) that picks the
	// backend, and Value what it is set to; an empty Selector runs the
	// chart's default.
	Selector, Value string
	// Unavailable says why this backend cannot run (the table prints n/a).
	Unavailable string
}

// Backends returns the rules backends to measure. The backend is a
// parameter of install-cni: the setting (whatever its name) that accepts
// both "iptables" and "nftables" and refuses other words. Without one,
// the chart's default (the iptables backend) runs and nftables is n/a.
func Backends() []Backend {
	sel := backendSelector()
	if sel == "" {
		return []Backend{
			{Name: "iptables"},
			{Name: "nftables", Unavailable: "install-cni has no setting that selects an nftables backend yet"},
		}
	}
	return []Backend{
		{Name: "iptables", Selector: sel, Value: "iptables"},
		{Name: "nftables", Selector: sel, Value: "nftables"},
	}
}

var optionRow = regexp.MustCompile("(?m)^\\| `--([a-z0-9-]+)` \\|")

// backendSelector finds the install-cni setting that chooses between
// the iptables and nftables backends by asking install-cni's own parser.
func backendSelector() string {
	var doc bytes.Buffer
	if err := agentconfig.WriteMarkdown(&doc); err != nil {
		return ""
	}
	accepts := func(name, value string) bool {
		env := map[string]string{agentconfig.EnvName("node-name"): "n", agentconfig.EnvName(name): value}
		_, err := agentconfig.Parse(nil, func(k string) string { return env[k] }, io.Discard)
		return err == nil
	}
	for _, m := range optionRow.FindAllSubmatch(doc.Bytes(), -1) {
		name := string(m[1])
		if accepts(name, "nftables") && accepts(name, "iptables") && !accepts(name, "no-such-backend") {
			return name
		}
	}
	return ""
}
