package realnode

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
)

// HostSnapshot is the host state a node could leave changed: mounts,
// cgroups, links, iptables (every flavour), nftables, ipsets and the
// well-known files. Tests take one before Up and one after Down and
// compare them.
type HostSnapshot struct {
	Sections map[string][]string
}

// TakeHostSnapshot records the host state.
func TakeHostSnapshot() (HostSnapshot, error) {
	s := HostSnapshot{Sections: map[string][]string{}}
	mounts, err := mountPoints()
	if err != nil {
		return s, err
	}
	for _, m := range mounts {
		s.add("mounts", fmt.Sprintf("%s %s %s", m.Point, m.FSType, m.Root))
	}
	roots, err := cgroupMounts()
	if err != nil {
		return s, err
	}
	for _, r := range roots {
		for _, c := range topCgroups() {
			if under(c, r) {
				s.add("cgroups", c)
			}
		}
	}
	links, err := linkNames()
	if err != nil {
		return s, err
	}
	s.Sections["links"] = links
	for _, f := range iptablesFlavours {
		save, err := iptablesSave(f)
		if err != nil {
			return s, err
		}
		s.Sections[f] = normalizeRules(save)
	}
	out, err := exec.Command("nft", "list", "ruleset").Output()
	if err != nil {
		return s, fmt.Errorf("nft list ruleset: %w", err)
	}
	s.Sections["nft"] = normalizeRules(string(out))
	sets, err := ipsetNames()
	if err != nil {
		return s, err
	}
	s.Sections["ipset"] = sets
	for p := range existing(hostPaths) {
		s.add("files", p)
	}
	for k, v := range readSysctls() {
		s.add("sysctl", k+"="+v)
	}
	for _, v := range s.Sections {
		slices.Sort(v)
	}
	return s, nil
}

func (s *HostSnapshot) add(section, line string) {
	s.Sections[section] = append(s.Sections[section], line)
}

// Diff lists what differs from before, one "section: + line" or
// "section: - line" each, sorted.
func (s HostSnapshot) Diff(before HostSnapshot) []string {
	var out []string
	keys := map[string]bool{}
	for k := range s.Sections {
		keys[k] = true
	}
	for k := range before.Sections {
		keys[k] = true
	}
	for k := range keys {
		count := map[string]int{}
		for _, l := range before.Sections[k] {
			count[l]--
		}
		for _, l := range s.Sections[k] {
			count[l]++
		}
		for l, n := range count {
			for ; n > 0; n-- {
				out = append(out, k+": + "+l)
			}
			for ; n < 0; n++ {
				out = append(out, k+": - "+l)
			}
		}
	}
	sort.Strings(out)
	return out
}

// Relevant keeps the lines of a Diff that a node could have caused: other
// programs on a shared machine change the host too (test netns mounts,
// their veths), and those are not ours to report.
func Relevant(diff []string) []string {
	markers := []string{"KUBE-", dirPrefix, guardPrefix, "ambient-probe", "containerd", "kubelet", "veth", "ztunnel"}
	// A host path that became a mount point was made by another program
	// (Down leaves it, removeNew says why).
	mountedNow := map[string]bool{}
	for _, l := range diff {
		if rest, ok := strings.CutPrefix(l, "mounts: + "); ok {
			mountedNow[strings.Fields(rest)[0]] = true
		}
	}
	var out []string
	for _, l := range diff {
		section, _, _ := strings.Cut(l, ":")
		if section == "files" || section == "sysctl" {
			if p, ok := strings.CutPrefix(l, "files: + "); ok {
				if real, err := filepath.EvalSymlinks(p); err == nil && mountedNow[real] {
					continue
				}
			}
			out = append(out, l)
			continue
		}
		// The node only adds elsewhere (and removes what it added): a
		// line that went away is another program's.
		if !strings.HasPrefix(l, section+": + ") {
			continue
		}
		if section == "cgroups" {
			// kubelet's roots exactly; look-alikes are other programs'.
			if f := strings.Fields(l); slices.Contains(kubeletRoots, filepath.Base(f[len(f)-1])) || strings.Contains(l, dirPrefix) {
				out = append(out, l)
			}
			continue
		}
		what, ms := l, markers
		if section == "links" {
			// A link by its name ("NAME TYPE"): the node's are its pods'
			// veth… and its own anode… (bridge, cluster link, workers'
			// veths), while a suite beside it moves veth pairs of other
			// names through the host's namespace.
			what = strings.Fields(strings.TrimPrefix(l, "links: + "))[0]
			ms = append(slices.Clip(markers), "anode")
		}
		for _, m := range ms {
			if strings.Contains(what, m) {
				out = append(out, l)
				break
			}
		}
	}
	return out
}
