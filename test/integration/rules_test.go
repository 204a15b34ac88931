package integration

import (
	"bufio"
	"fmt"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/ourrules"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The suite runs the agent with the shipped --rules-backend (auto: the
// native nftables backend where the kernel has it, as here). These helpers
// read a pod's rules in whichever backend the agent chose; the traffic
// matrix over every backend lives in pkg/rulesbackend.

// nftablesBackend is rulesbackend's name for the native backend.
const nftablesBackend = ourrules.NFTablesBackend

// openRules builds, for the test's own reads, the backend the agent chose:
// the same configured value (and so the same choice), with the host probe
// in the node's stand-in host netns.
func (n *node) openRules() {
	n.t.Helper()
	b, err := rulesbackend.New(rulesbackend.Config{
		Backend: n.cfg.RulesBackend, HostNetns: n.hostNS.Path(),
		Probe: ruleset.HostProbeConfig{ProbeSNATv4: n.cfg.ProbeSNATv4, ProbeSNATv6: n.cfg.ProbeSNATv6},
	})
	if err != nil {
		n.t.Fatalf("rules backend: %v", err)
	}
	n.t.Cleanup(func() { _ = b.Close() })
	if b.Name == nftablesBackend {
		testnet.RequireCommands(n.t, "nft")
	} else {
		f := n.iptablesFlavour(b.Name)
		testnet.RequireCommands(n.t, f.SaveCmd(ruleset.IPv4), f.SaveCmd(ruleset.IPv6), f.Cmd(ruleset.IPv4))
	}
	n.rules = b
}

// iptablesFlavour is the flavour of an iptables backend name
// ("iptables-nft").
func (n *node) iptablesFlavour(name string) iptables.Backend {
	n.t.Helper()
	return ourrules.IPTablesFlavour(n.t, name)
}

// requireAgentBackend fails unless the running agent chose what the test
// reads.
func (n *node) requireAgentBackend() {
	n.t.Helper()
	if got := n.d.RulesBackend(); got != n.rules.Name {
		n.t.Fatalf("the agent runs the %s rules backend, the test reads %s", got, n.rules.Name)
	}
}

// dump is everything of the agent's backend in a pod's netns, with what
// identifies each rule: iptables-save -c of both families (counters), or
// nft -a list ruleset (handles, which a re-created rule does not keep).
func (n *node) dump(netnsPath string) string {
	n.t.Helper()
	if n.rules.Name == nftablesBackend {
		return n.inNetns(netnsPath, "nft", "-a", "list", "ruleset")
	}
	f := n.iptablesFlavour(n.rules.Name)
	return n.inNetns(netnsPath, f.SaveCmd(ruleset.IPv4), "-c") + n.inNetns(netnsPath, f.SaveCmd(ruleset.IPv6), "-c")
}

func (n *node) inNetns(netnsPath, name string, args ...string) string {
	n.t.Helper()
	out, err := exec.Command("nsenter", append([]string{"--net=" + netnsPath, "--", name}, args...)...).CombinedOutput()
	if err != nil {
		n.t.Fatalf("%s %v in %s: %v\n%s", name, args, netnsPath, err, out)
	}
	return string(out)
}

// hasRules reports whether the pod's netns holds the agent's backend's
// redirection rules.
func (n *node) hasRules(p *kubesim.Pod) bool {
	n.t.Helper()
	ipt, nft := n.ourRules(p.NS.Path())
	if n.rules.Name == nftablesBackend {
		return nft
	}
	return ipt
}

// ourRules reports whether the netns holds our iptables chains (either
// flavour) and our nftables tables.
func (n *node) ourRules(netnsPath string) (ipt, nft bool) {
	n.t.Helper()
	return ourrules.OurRules(n.t, netnsPath)
}

// rulesDump is what a failure message shows of a pod's rules.
func (n *node) rulesDump(p *kubesim.Pod) string {
	n.t.Helper()
	return n.dump(p.NS.Path())
}

// inProbeSet reports whether the pod's IPv4 address is in the probe SNAT
// set of the stand-in host netns.
func (n *node) inProbeSet(p *kubesim.Pod) bool {
	n.t.Helper()
	ips, err := n.rules.Probe.IPs()
	if err != nil {
		n.t.Fatalf("list host probe set: %v", err)
	}
	return slices.Contains(ips, p.Addr(4))
}

// deleteFirstOutputRule deletes, behind the agent's back, the first rule
// of the pod's outbound nat chain, as an operator or another tool would.
func (n *node) deleteFirstOutputRule(netnsPath string) {
	n.t.Helper()
	ourrules.DeleteFirstOutputRule(n.t, n.rules.Name, netnsPath)
}

// counterLine is one rule of iptables-save -c: "[packets:bytes] -A ...".
var counterLine = regexp.MustCompile(`^\[(\d+):(\d+)\] (-A .*)$`)

// rulesKept compares two dumps of a pod (see dump) taken across an agent
// restart and fails unless every rule is the very one that was there.
// iptables: the same rules, each with counters no smaller than before (a
// re-created rule starts at zero), and some rule of ours must have counted
// traffic before, or the comparison would prove nothing. nftables: the
// same listing including every table's, chain's and rule's handle (the
// kernel gives a re-created object a new one), holding our tables.
func (n *node) rulesKept(before, after string) error {
	if n.rules.Name == nftablesBackend {
		if !strings.Contains(before, "table inet "+nftables.TableNAT+" { # handle ") {
			return fmt.Errorf("no nat table of ours before the restart:\n%s", before)
		}
		if before != after {
			return fmt.Errorf("rules changed across the restart:\nbefore:\n%s\nafter:\n%s", before, after)
		}
		return nil
	}
	parse := func(s string) ([]string, map[string][2]uint64) {
		var order []string
		counts := map[string][2]uint64{}
		table := ""
		sc := bufio.NewScanner(strings.NewReader(s))
		for sc.Scan() {
			line := sc.Text()
			if strings.HasPrefix(line, "*") {
				table = line
			}
			m := counterLine.FindStringSubmatch(line)
			if m == nil {
				continue
			}
			p, _ := strconv.ParseUint(m[1], 10, 64)
			b, _ := strconv.ParseUint(m[2], 10, 64)
			key := table + " " + m[3]
			for slices.Contains(order, key) {
				key += " (again)" // identical rules: keep them apart by position
			}
			order = append(order, key)
			counts[key] = [2]uint64{p, b}
		}
		return order, counts
	}
	bo, bc := parse(before)
	ao, ac := parse(after)
	if !slices.Equal(bo, ao) {
		return fmt.Errorf("rules changed across the restart:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	counted := false
	for _, k := range bo {
		if ac[k][0] < bc[k][0] || ac[k][1] < bc[k][1] {
			return fmt.Errorf("rule %q was re-created: counters %v before, %v after", k, bc[k], ac[k])
		}
		if strings.Contains(k, "ISTIO_") && bc[k][0] > 0 {
			counted = true
		}
	}
	if !counted {
		return fmt.Errorf("no rule of ours had counted traffic before the restart:\n%s", before)
	}
	return nil
}
