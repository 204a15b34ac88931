package simnode

import (
	"fmt"
	"io"
	"log/slog"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
)

// Rules builds the rules backend the chart's DaemonSet selects (its
// --rules-backend, auto by default: nftables where the kernel has it), as
// install-cni does, with the host probe in hostNetns ("" = the caller's).
// It is for a suite that runs the agent's rules in-process without the
// rest of a node; the caller closes it.
func Rules(s *Shipped, hostNetns string, log *slog.Logger) (*rulesbackend.Backend, error) {
	c, err := installcni.Parse(nil, func(k string) string { return s.Env[k] }, io.Discard)
	if err != nil {
		return nil, fmt.Errorf("install-cni refuses the chart's environment: %w", err)
	}
	return rulesbackend.New(rulesbackend.Config{
		Backend: c.RulesBackend, HostNetns: hostNetns, Logger: log,
		Probe: ruleset.HostProbeConfig{ProbeSNATv4: c.ProbeSNATv4, ProbeSNATv6: c.ProbeSNATv6},
	})
}
