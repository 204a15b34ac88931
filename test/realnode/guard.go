package realnode

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

// guardPrefix names the egress guard's nftables table.
const guardPrefix = "ambient_node_guard_"

// The egress guard is an nftables table of the node's own that counts and
// rejects every connection attempt that would leave the machine:
//
//   - output: packets from sockets in the node's cgroup (everything the node
//     started: control plane, containerd, kubelet, helm) or kubelet's pod
//     cgroup (containers, also the host-network ones) to anything but
//     loopback and the pod network: a client that ignored the loopback API
//     server override would go to the kubernetes Service IP, off the
//     machine, and be counted here;
//   - forward: packets from the pod bridge to anything but the pod network
//     (or link-local multicast and broadcast, which bridged pod-to-pod
//     traffic shows here when br_netfilter is loaded).
//
// checkGuard fails when any counter is not zero; Down removes the table.
func (n *Node) startGuard() error {
	n.st.Guard = guardPrefix + randHex(8)
	if err := n.saveState(); err != nil {
		return err
	}
	rel, err := filepath.Rel(cgroupV2Mount(), n.st.Cgroup)
	if err != nil {
		return err
	}
	// nft resolves cgroupv2 paths below /sys/fs/cgroup; on a hybrid host
	// the unified hierarchy is mounted one level down.
	path, err := filepath.Rel("/sys/fs/cgroup", filepath.Join(cgroupV2Mount(), rel))
	if err != nil {
		return err
	}
	allowed4 := "{ 127.0.0.0/8, " + n.Subnet + " }"
	script := fmt.Sprintf(`table inet %[1]s {
	chain output {
		type filter hook output priority -300; policy accept;
		socket cgroupv2 level 1 "%[2]s" meta nfproto ipv4 ip daddr != %[3]s counter reject comment "node to outside"
		socket cgroupv2 level 1 "%[2]s" meta nfproto ipv6 ip6 daddr != ::1 ip6 daddr != fe80::/10 ip6 daddr != ff02::/16 counter reject comment "node to outside (IPv6)"
	}
	chain forward {
		type filter hook forward priority -300; policy accept;
		iifname "%[4]s" meta nfproto ipv4 ip daddr != { %[5]s, 224.0.0.0/24, 255.255.255.255 } counter reject comment "pods to outside"
		iifname "%[4]s" meta nfproto ipv6 ip6 daddr != { fe80::/10, ff00::/8 } counter reject comment "pods to outside (IPv6)"
	}
}
`, n.st.Guard, path, allowed4, n.Bridge, n.Subnet)
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("install egress guard: %v: %s", err, out)
	}
	return nil
}

// extendGuard is called once kubelet runs: containers may sit in kubelet's
// kubepods cgroup of the unified hierarchy rather than the node's, so the
// guard counts those too. Nothing to do when runc leaves them in place.
func (n *Node) extendGuard() error {
	root := cgroupV2Mount()
	kp := filepath.Join(root, "kubepods")
	if !exists(kp) {
		return nil
	}
	path, err := filepath.Rel("/sys/fs/cgroup", kp)
	if err != nil {
		return err
	}
	script := fmt.Sprintf(`add rule inet %s output socket cgroupv2 level 1 "%s" meta nfproto ipv4 ip daddr != { 127.0.0.0/8, %s } counter reject comment "pods (host network) to outside"`+"\n", n.st.Guard, path, n.Subnet)
	cmd := exec.Command("nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("extend egress guard: %v: %s", err, out)
	}
	return nil
}

var guardCounter = regexp.MustCompile(`counter packets (\d+) bytes \d+.*comment "([^"]*)"`)

// GuardHits returns the guard's non-zero counters since Up (or the last
// ResetGuard): connection attempts that would have left the machine, by
// rule. Empty is good.
func (n *Node) GuardHits() (map[string]int, error) {
	hits, err := n.rawGuardHits()
	if err != nil {
		return nil, err
	}
	for k, v := range n.guardBase {
		if hits[k] -= v; hits[k] <= 0 {
			delete(hits, k)
		}
	}
	return hits, nil
}

// rawGuardHits reads the guard's non-zero counters.
func (n *Node) rawGuardHits() (map[string]int, error) {
	if n.st == nil || n.st.Guard == "" {
		return nil, nil
	}
	out, err := exec.Command("nft", "list", "table", "inet", n.st.Guard).Output()
	if err != nil {
		return nil, fmt.Errorf("read egress guard: %w", err)
	}
	hits := map[string]int{}
	for _, m := range guardCounter.FindAllStringSubmatch(string(out), -1) {
		if c, _ := strconv.Atoi(m[1]); c > 0 {
			hits[m[2]] += c
		}
	}
	return hits, nil
}

// checkGuard fails when the guard counted anything.
func (n *Node) checkGuard() error {
	hits, err := n.GuardHits()
	if err != nil {
		return err
	}
	if len(hits) > 0 {
		out, _ := exec.Command("nft", "list", "table", "inet", n.st.Guard).Output()
		return fmt.Errorf("the node tried to send traffic off the machine: %v\n%s", hits, out)
	}
	return nil
}

func removeGuard(table string) error {
	out, err := exec.Command("nft", "delete", "table", "inet", table).CombinedOutput()
	if err != nil && !strings.Contains(string(out), "No such file") {
		return fmt.Errorf("remove egress guard %s: %v: %s", table, err, out)
	}
	return nil
}

// ResetGuard makes the guard's current counts the new zero (after a test
// proved they count): nftables cannot reset anonymous rule counters in
// place, so GuardHits subtracts this baseline.
func (n *Node) ResetGuard() error {
	hits, err := n.rawGuardHits()
	if err != nil {
		return err
	}
	n.guardBase = hits
	return nil
}
