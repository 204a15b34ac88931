package realnode

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// hostPaths are the host files and directories a kubelet, containerd and
// the chart may create outside the node's own directory (most at fixed
// paths the software does not let us move). Up records which exist; Down
// removes those that did not, deepest first.
var hostPaths = []string{
	"/var/lib/kubelet",
	"/var/lib/kubelet/device-plugins",
	"/var/lib/kubelet/plugins",
	"/var/lib/kubelet/plugins_registry",
	"/var/lib/kubelet/pod-resources",
	"/var/lib/kubelet/checkpoints",
	"/var/log/containers",
	"/var/log/pods",
	"/var/lib/cni",
	"/var/lib/cni/results",
	"/var/lib/cni/networks",
	"/var/lib/containerd",
	"/run/containerd",
	"/run/containerd/runc",
	"/run/containerd/s",
	"/run/containerd/io.containerd.runtime.v2.task",
	"/opt/containerd",
	"/etc/cni",
	"/etc/cni/net.d",
	"/opt/cni",
	"/opt/cni/bin",
	"/run/netns",
	"/var/run/netns",
	"/var/run/ztunnel",
	"/var/run/ambient-cni",
	"/etc/kubernetes",
}

// Not in hostPaths: /run/xtables.lock, which the chart mounts (created
// if missing) and every iptables command creates on first use. It is a
// lock file: removing it while another program's iptables holds it would
// let the next one take a second lock, and on a host where make test's
// iptables tests run beside the e2e it appears whenever they first run,
// not because of the node. Leaving it is what any iptables user does.

// hostSysctls are the kernel settings the node changes: the bridge plugin
// turns on forwarding (isGateway), kubelet sets its kernel tunables
// (protectKernelDefaults false modifies them; true would refuse to start
// on a host that has other values). Down writes back what Up found.
var hostSysctls = []string{
	"net/ipv4/ip_forward",
	"net/ipv6/conf/all/forwarding",
	"vm/overcommit_memory",
	"vm/panic_on_oom",
	"kernel/panic",
	"kernel/panic_on_oops",
	"kernel/keys/root_maxkeys",
	"kernel/keys/root_maxbytes",
}

// readSysctls returns the current value of every hostSysctls entry.
func readSysctls() map[string]string {
	out := map[string]string{}
	for _, k := range hostSysctls {
		if b, err := os.ReadFile(filepath.Join("/proc/sys", k)); err == nil {
			out[k] = strings.TrimSpace(string(b))
		}
	}
	return out
}

// restoreSysctls writes back every value that differs from before.
func restoreSysctls(before map[string]string) []error {
	var errs []error
	now := readSysctls()
	for _, k := range hostSysctls {
		want, ok := before[k]
		if !ok || now[k] == want {
			continue
		}
		if err := os.WriteFile(filepath.Join("/proc/sys", k), []byte(want+"\n"), 0o644); err != nil {
			errs = append(errs, fmt.Errorf("restore %s=%s: %w", k, want, err))
		}
	}
	return errs
}

// kubeletChains are the iptables chains kubelet creates in the host netns.
var kubeletChains = []string{"KUBE-FIREWALL", "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT"}

// iptablesFlavours are every save/command pair the host may have rules in.
var iptablesFlavours = []string{"iptables-nft", "iptables-legacy", "ip6tables-nft", "ip6tables-legacy"}

// existing returns which of paths exist.
func existing(paths []string) map[string]bool {
	out := map[string]bool{}
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil {
			out[p] = true
		}
	}
	return out
}

// removeNew removes the paths of hostPaths that did not exist before,
// deepest first. A path that exists and existed before is left alone,
// whatever grew inside it, except the listed children.
func removeNew(before map[string]bool) []error {
	paths := slices.Clone(hostPaths)
	sort.Slice(paths, func(i, j int) bool { return strings.Count(paths[i], "/") > strings.Count(paths[j], "/") })
	// A path that is itself a mount point now is another program's: the
	// node only mounts below its paths, while ip netns (and the suites'
	// netns helpers, which run beside the e2e in make check) make
	// /run/netns a bind mount of its own. Removing it is not ours to do
	// (and fails busy).
	mounted := map[string]bool{}
	if ms, err := mountPoints(); err == nil {
		for _, m := range ms {
			mounted[m.Point] = true
		}
	}
	var errs []error
	for _, p := range paths {
		if before[p] {
			continue
		}
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		if real, err := filepath.EvalSymlinks(p); err == nil && mounted[real] {
			continue
		}
		// Whatever kubelet left mounted below is gone by now (unmountUnder),
		// so RemoveAll cannot descend into a mounted file system.
		if err := os.RemoveAll(p); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", p, err))
		}
	}
	return errs
}

// mountPoints returns this mount namespace's mount points, in mount order.
func mountPoints() ([]mountInfo, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []mountInfo
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 10 {
			continue
		}
		sep := slices.Index(fields, "-")
		if sep < 0 || sep+2 >= len(fields) {
			continue
		}
		out = append(out, mountInfo{Point: unescapeMount(fields[4]), Root: unescapeMount(fields[3]), FSType: fields[sep+1], Source: fields[sep+2], Shared: strings.Contains(strings.Join(fields[6:sep], " "), "shared:")})
	}
	return out, sc.Err()
}

type mountInfo struct {
	Point, Root, FSType, Source string
	Shared                      bool
}

// unescapeMount undoes the octal escapes (\040 for a space) of mountinfo.
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// under reports whether p is dir or inside it.
func under(p, dir string) bool {
	dir = strings.TrimSuffix(dir, "/")
	return p == dir || strings.HasPrefix(p, dir+"/")
}

// unmountUnder detaches every mount at or below the given directories,
// deepest first, until none is left (mounts can be stacked).
func unmountUnder(dirs ...string) error {
	for round := 0; round < 20; round++ {
		mounts, err := mountPoints()
		if err != nil {
			return err
		}
		var points []string
		for _, m := range mounts {
			for _, d := range dirs {
				if d != "" && under(m.Point, d) {
					points = append(points, m.Point)
					break
				}
			}
		}
		if len(points) == 0 {
			return nil
		}
		sort.SliceStable(points, func(i, j int) bool { return strings.Count(points[i], "/") > strings.Count(points[j], "/") })
		for _, p := range points {
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				return fmt.Errorf("unmount %s: %w", p, err)
			}
		}
	}
	return fmt.Errorf("mounts below %v keep coming back", dirs)
}

// makeSharedBind bind-mounts dir onto itself and makes it a shared mount,
// so that netns files the runtime mounts inside later propagate into
// containers that mount the directory with HostToContainer propagation
// (every mount on this host is private otherwise).
func makeSharedBind(dir string) error {
	if err := os.MkdirAll(dir, 0o711); err != nil {
		return err
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind mount %s: %w", dir, err)
	}
	if err := unix.Mount("", dir, "", unix.MS_SHARED, ""); err != nil {
		_ = unix.Unmount(dir, unix.MNT_DETACH)
		return fmt.Errorf("make %s shared: %w", dir, err)
	}
	return nil
}

// cgroupMounts returns the mount points of every cgroup hierarchy (v1
// controllers, name=systemd, and the v2 mount).
func cgroupMounts() ([]string, error) {
	mounts, err := mountPoints()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range mounts {
		if (m.FSType == "cgroup" || m.FSType == "cgroup2") && !slices.Contains(out, m.Point) {
			out = append(out, m.Point)
		}
	}
	return out, nil
}

// cgroupV2Mount is where the unified hierarchy is mounted ("" if nowhere).
func cgroupV2Mount() string {
	mounts, err := mountPoints()
	if err != nil {
		return ""
	}
	for _, m := range mounts {
		if m.FSType == "cgroup2" {
			return m.Point
		}
	}
	return ""
}

// kubeletRoots are the top-level cgroups kubelet makes for pods: its
// cgroupfs driver's "kubepods" (this node) and the systemd driver's slice.
// Exact names only: other programs on a shared machine make look-alikes
// (a kubelet simulator's "kubepods-sim-..."), and those are not ours.
var kubeletRoots = []string{"kubepods", "kubepods.slice"}

// kubeletCgroups lists kubelet's pod root cgroups in every hierarchy.
func kubeletCgroups() []string {
	var out []string
	for _, c := range topCgroups() {
		if slices.Contains(kubeletRoots, filepath.Base(c)) {
			out = append(out, c)
		}
	}
	return out
}

// topCgroups lists the top-level cgroups of every hierarchy, as paths.
func topCgroups() []string {
	roots, err := cgroupMounts()
	if err != nil {
		return nil
	}
	var out []string
	for _, r := range roots {
		des, err := os.ReadDir(r)
		if err != nil {
			continue
		}
		for _, de := range des {
			if de.IsDir() {
				out = append(out, filepath.Join(r, de.Name()))
			}
		}
	}
	return out
}

// removeCgroupTree kills every process in the cgroup tree at dir and
// removes its cgroups bottom-up. Killing is needed: a container whose
// shim died keeps running in its cgroup.
func removeCgroupTree(dir string) error {
	var dirs []string
	_ = filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	deadline := time.Now().Add(30 * time.Second)
	for i := len(dirs) - 1; i >= 0; i-- {
		d := dirs[i]
		for {
			pids := cgroupPids(d)
			if len(pids) == 0 {
				break
			}
			for _, pid := range pids {
				if pid != os.Getpid() {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
			// A frozen cgroup (freezer v1) holds its killed tasks.
			_ = os.WriteFile(filepath.Join(d, "freezer.state"), []byte("THAWED"), 0o644)
			if time.Now().After(deadline) {
				return fmt.Errorf("cgroup %s still has processes %v", d, pids)
			}
			time.Sleep(50 * time.Millisecond)
		}
		for {
			err := unix.Rmdir(d)
			if err == nil || errors.Is(err, unix.ENOENT) {
				break
			}
			if !errors.Is(err, unix.EBUSY) || time.Now().After(deadline) {
				return fmt.Errorf("remove cgroup %s: %w", d, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

func cgroupPids(dir string) []int {
	b, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// iptablesChains returns table → chains of one iptables flavour's save
// output ("" if the flavour is not installed or has no tables).
func iptablesSave(flavour string) (string, error) {
	if _, err := exec.LookPath(flavour + "-save"); err != nil {
		return "", nil
	}
	out, err := exec.Command(flavour + "-save").Output()
	if err != nil {
		return "", fmt.Errorf("%s-save: %w", flavour, err)
	}
	return string(out), nil
}

// saveChains parses iptables-save output into table → chain names.
func saveChains(save string) map[string][]string {
	out := map[string][]string{}
	table := ""
	for _, line := range strings.Split(save, "\n") {
		switch {
		case strings.HasPrefix(line, "*"):
			table = line[1:]
			if _, ok := out[table]; !ok {
				out[table] = nil
			}
		case strings.HasPrefix(line, ":") && table != "":
			if f := strings.Fields(line[1:]); len(f) > 0 {
				out[table] = append(out[table], f[0])
			}
		}
	}
	return out
}

// removeChains deletes the named chains of one flavour, with every rule
// that jumps to them, in each table where they did not exist before.
func removeChains(flavour string, names []string, before map[string][]string) []error {
	save, err := iptablesSave(flavour)
	if err != nil || save == "" {
		if err != nil {
			return []error{err}
		}
		return nil
	}
	var errs []error
	table := ""
	now := saveChains(save)
	drop := map[string]map[string]bool{}
	for t, chains := range now {
		for _, c := range chains {
			if slices.Contains(names, c) && !slices.Contains(before[t], c) {
				if drop[t] == nil {
					drop[t] = map[string]bool{}
				}
				drop[t][c] = true
			}
		}
	}
	if len(drop) == 0 {
		return nil
	}
	for _, line := range strings.Split(save, "\n") {
		if strings.HasPrefix(line, "*") {
			table = line[1:]
			continue
		}
		if !strings.HasPrefix(line, "-A ") || drop[table] == nil {
			continue
		}
		args, err := splitRule(line)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		jump := ""
		if i := slices.Index(args, "-j"); i >= 0 && i+1 < len(args) {
			jump = args[i+1]
		}
		if drop[table][args[1]] || !drop[table][jump] {
			continue // rules inside dropped chains go with the flush
		}
		args[0] = "-D"
		if out, err := exec.Command(flavour, append([]string{"-w", "-t", table}, args...)...).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("%s -t %s %s: %v: %s", flavour, table, strings.Join(args, " "), err, out))
		}
	}
	for t, chains := range drop {
		for c := range chains {
			for _, op := range []string{"-F", "-X"} {
				if out, err := exec.Command(flavour, "-w", "-t", t, op, c).CombinedOutput(); err != nil {
					errs = append(errs, fmt.Errorf("%s -t %s %s %s: %v: %s", flavour, t, op, c, err, out))
				}
			}
		}
	}
	return errs
}

// splitRule splits an iptables-save rule line into arguments, honouring
// the double quotes it puts around comments.
func splitRule(line string) ([]string, error) {
	var args []string
	var cur strings.Builder
	inArg, quoted := false, false
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case quoted && c == '\\' && i+1 < len(line):
			i++
			cur.WriteByte(line[i])
		case c == '"':
			quoted = !quoted
			inArg = true
		case c == ' ' && !quoted:
			if inArg {
				args = append(args, cur.String())
				cur.Reset()
				inArg = false
			}
		default:
			cur.WriteByte(c)
			inArg = true
		}
	}
	if quoted {
		return nil, fmt.Errorf("unterminated quote in rule %q", line)
	}
	if inArg {
		args = append(args, cur.String())
	}
	if len(args) < 2 {
		return nil, fmt.Errorf("short rule %q", line)
	}
	return args, nil
}

// nftTables lists the host's nftables tables as "family name".
func nftTables() ([]string, error) {
	out, err := exec.Command("nft", "list", "tables").Output()
	if err != nil {
		return nil, fmt.Errorf("nft list tables: %w", err)
	}
	var tables []string
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) == 3 && f[0] == "table" {
			tables = append(tables, f[1]+" "+f[2])
		}
	}
	return tables, nil
}

// removeEmptyNewTables deletes nftables tables that did not exist before
// and hold no rule (iptables-nft leaves its tables behind when the last
// chain of kubelet's is gone).
func removeEmptyNewTables(before []string) []error {
	now, err := nftTables()
	if err != nil {
		return []error{err}
	}
	var errs []error
	for _, t := range now {
		if slices.Contains(before, t) {
			continue
		}
		f := strings.Fields(t)
		out, err := exec.Command("nft", "list", "table", f[0], f[1]).Output()
		if err != nil {
			continue
		}
		if hasNftRules(string(out)) {
			continue
		}
		if out, err := exec.Command("nft", "delete", "table", f[0], f[1]).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("nft delete table %s: %v: %s", t, err, out))
		}
	}
	return errs
}

// hasNftRules reports whether an nft table listing has a rule, set or map
// (anything but chain headers and their policies).
func hasNftRules(listing string) bool {
	for _, line := range strings.Split(listing, "\n") {
		l := strings.TrimSpace(line)
		switch {
		case l == "", l == "}", strings.HasPrefix(l, "table "), strings.HasPrefix(l, "chain "), strings.HasPrefix(l, "type "), strings.HasPrefix(l, "policy "):
		default:
			return true
		}
	}
	return false
}

// ipsetNames lists the host's ipsets.
func ipsetNames() ([]string, error) {
	if _, err := exec.LookPath("ipset"); err != nil {
		return nil, nil
	}
	out, err := exec.Command("ipset", "list", "-n").Output()
	if err != nil {
		return nil, fmt.Errorf("ipset list -n: %w", err)
	}
	return strings.Fields(string(out)), nil
}

// linkNames lists the host netns's links as "name kind".
func linkNames() ([]string, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range links {
		out = append(out, l.Attrs().Name+" "+l.Type())
	}
	slices.Sort(out)
	return out, nil
}

// normalizeCounters drops the packet/byte counters that change on their
// own from iptables-save and nft listings.
var (
	saveCounters = regexp.MustCompile(`\[\d+:\d+\]`)
	nftCounters  = regexp.MustCompile(`counter packets \d+ bytes \d+`)
)

func normalizeRules(s string) []string {
	var out []string
	for _, line := range strings.Split(s, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		line = saveCounters.ReplaceAllString(line, "[]")
		line = nftCounters.ReplaceAllString(line, "counter")
		out = append(out, line)
	}
	return out
}
