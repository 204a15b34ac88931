package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
)

// hostState is what a test could leave behind in the host network
// namespace (the package's own: see TestMain).
type hostState struct {
	rules  map[string][]string // save command -> lines
	ipsets []string
}

var counters = regexp.MustCompile(`\[\d+:\d+\]`)

// nftCounters are the counters in an nft listing (iptables-nft rules carry
// them).
var nftCounters = regexp.MustCompile(`counter packets \d+ bytes \d+`)

// snapshotHost reads the host's rules (every installed iptables flavour
// and the whole nf_tables ruleset, where the nftables backend's tables
// would be) and ipsets.
func snapshotHost(t testing.TB) hostState {
	t.Helper()
	st := hostState{rules: map[string][]string{}}
	for _, cmd := range []string{"iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save", "ip6tables-nft-save"} {
		if _, err := exec.LookPath(cmd); err != nil {
			continue
		}
		out, err := exec.Command(cmd).Output()
		if err != nil {
			t.Fatalf("%s: %v", cmd, err)
		}
		var lines []string
		for l := range strings.SplitSeq(string(out), "\n") {
			if l == "" || strings.HasPrefix(l, "#") {
				continue
			}
			lines = append(lines, counters.ReplaceAllString(l, ""))
		}
		st.rules[cmd] = lines
	}
	if _, err := exec.LookPath("nft"); err == nil {
		out, err := exec.Command("nft", "list", "ruleset").Output()
		if err != nil {
			t.Fatalf("nft list ruleset: %v", err)
		}
		var lines []string
		for l := range strings.SplitSeq(string(out), "\n") {
			if l = strings.TrimSpace(l); l != "" {
				lines = append(lines, nftCounters.ReplaceAllString(l, "counter"))
			}
		}
		st.rules["nft list ruleset"] = lines
	}
	if _, err := exec.LookPath("ipset"); err == nil {
		out, err := exec.Command("ipset", "list").Output()
		if err != nil {
			t.Fatalf("ipset list: %v", err)
		}
		st.ipsets = strings.Split(strings.TrimSpace(string(out)), "\n")
	}
	return st
}

// added returns the lines of after that are not in before.
func added(before, after []string) []string {
	var out []string
	for _, l := range after {
		if !slices.Contains(before, l) {
			out = append(out, l)
		}
	}
	return out
}

// requireHostClean snapshots the host now and, once the test and all its
// cleanups are done, requires that the test left nothing behind: no host
// rule or ipset of ours or naming its bridge or pod subnet, no bridge, no
// pod netns, no kubesim cgroup. The host is the package's own network
// namespace, where nothing but this package's tests runs; changes that
// are not ours are still only logged. Call it before newNode; node and
// pods are read at the end.
func requireHostClean(t *testing.T, n **node, pods *[]*kubesim.Pod) {
	t.Helper()
	before := snapshotHost(t)
	t.Cleanup(func() {
		after := snapshotHost(t)
		if *n == nil {
			return
		}
		nd := *n
		subnet := strings.TrimSuffix(nd.subnet.Addr().String(), ".0") + "."
		ours := func(l string) bool {
			for _, m := range []string{iptables.ChainOutput, iptables.ChainPrerouting, iptables.ChainProbeSNAT,
				"ISTIO_", "AMBIENT_", ruleset.ProbeSetV4, ruleset.ProbeSetV6, nd.bridge, subnet,
				"istio-ambient-", nftables.TableHost} {
				if strings.Contains(l, m) {
					return true
				}
			}
			return false
		}
		report := func(what string, diff []string) {
			for _, l := range diff {
				if ours(l) {
					t.Errorf("host %s: left behind %q", what, l)
				} else {
					t.Logf("host %s changed during the test (not ours): %q", what, l)
				}
			}
		}
		for cmd, lines := range after.rules {
			report(cmd, added(before.rules[cmd], lines))
			report(cmd+" (removed)", added(lines, before.rules[cmd]))
		}
		report("ipset", added(before.ipsets, after.ipsets))
		// Cgroups are machine-wide: other packages' simulated kubelets
		// (the sandbox's, the benchmark's) make and remove theirs in the
		// same hierarchies meanwhile. This node's are all below its root.
		if nd.kube != nil {
			for _, h := range podproc.DefaultHierarchies() {
				if cg := filepath.Join(h, nd.kube.CgroupRoot()); exists(cg) {
					t.Errorf("kubesim cgroup left behind: %s", cg)
				}
			}
		}
		if _, err := os.Stat(filepath.Join("/sys/class/net", nd.bridge)); err == nil {
			t.Errorf("bridge %s left behind", nd.bridge)
		}
		for _, p := range *pods {
			if _, err := os.Stat(p.NS.Path()); err == nil {
				t.Errorf("pod netns %s left behind", p.NS.Path())
			}
		}
		for _, d := range []string{nd.dir} {
			if _, err := os.Stat(d); err == nil {
				t.Errorf("node dir %s left behind", d)
			}
		}
		t.Logf("host clean: %d rule dumps, %d ipset lines, %d pod netns checked", len(after.rules), len(after.ipsets), len(*pods))
	})
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}
