package bench

import (
	"bytes"
	"io"
	"regexp"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
)

// Backend is one rules backend the benchmark runs the agent with.
type Backend struct {
	// Name is what the table calls it: ShippedBackend for the chart's
	// default, else the backend selected ("iptables").
	Name string
	// Selector is the install-cni setting (flag name) that picks the
	// backend, and Value what it is set to; an empty Selector runs the
	// chart's default.
	Selector, Value string
	// Unavailable says why this backend cannot run (the table prints n/a).
	Unavailable string
}

// Backends returns the rules backends to measure: the chart's default
// (what ships; the column header shows the backend the agent resolved it
// to) and, for comparison, the iptables backend, chosen with install-cni's
// backend setting: the setting (whatever its name) that accepts both
// "iptables" and "nftables" and refuses other words. Without such a setting
// only the default runs and nftables is n/a.
func Backends() []Backend {
	sel := backendSelector()
	if sel == "" {
		return []Backend{
			{Name: ShippedBackend},
			{Name: "nftables", Unavailable: "install-cni has no setting that selects an nftables backend"},
		}
	}
	return []Backend{
		{Name: ShippedBackend},
		{Name: "iptables", Selector: sel, Value: "iptables"},
	}
}

// settings are the install-cni settings that select b (none for the
// chart's default): the benchmark's one parameter.
func (b Backend) settings() map[string]string {
	if b.Selector == "" {
		return nil
	}
	return map[string]string{b.Selector: b.Value}
}

// ShippedBackend names the run with the chart's default rules backend.
const ShippedBackend = "shipped"

var optionRow = regexp.MustCompile("(?m)^\\| `--([a-z0-9-]+)` \\|")

// backendSelector finds the install-cni setting that chooses between
// the iptables and nftables backends by asking install-cni's own parser.
func backendSelector() string {
	var doc bytes.Buffer
	if err := installcni.WriteMarkdown(&doc); err != nil {
		return ""
	}
	accepts := func(name, value string) bool {
		env := map[string]string{installcni.EnvName("node-name"): "n", installcni.EnvName(name): value}
		_, err := installcni.Parse(nil, func(k string) string { return env[k] }, io.Discard)
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
