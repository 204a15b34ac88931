package realnode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// A cluster of several real nodes on one machine. The first node (Node)
// runs in the host's namespaces with the control plane; every further node
// (Worker) joins the same API server with a kubelet and a containerd of its
// own, in a network namespace of its own (its own addresses, routes,
// netfilter rules, loopback ports) and a mount namespace of its own. In
// that mount namespace the worker's directory is mounted over the first
// node's, so every path of the first node (CNI dirs, netns dir, the
// chart's hostPaths, containerd's socket) names the worker's own files
// there: one chart, installed once with one set of values, resolves per
// node, as hostPaths do on real machines. The fixed host paths kubelet and
// containerd use (/var/lib/kubelet, /var/log/containers, /var/lib/cni,
// /run/containerd) are private per worker the same way, and each kubelet
// has its own cgroup root.
//
// The nodes meet on a bridge of the host (the cluster link): the first
// node's address is the bridge's, each worker's is on its veth. Nothing
// routes a worker anywhere else (no default route), so nothing it runs
// leaves the machine. Its loopback API server and registry are the first
// node's, forwarded into its network namespace. flanneld (kube subnet
// manager, host-gw backend) runs on every node, leases each node's
// spec.podCIDR and routes the pod networks between them; each node's
// conflist is the bridge + host-local one flannel's CNI plugin delegates,
// on its lease.

// FlannelNetwork is flannel's Network: every node's pod subnet is in it
// (pickSubnet picks them there).
const FlannelNetwork = "10.200.0.0/13"

// flannelChains are the iptables chains flanneld creates in a node's
// network namespace (the first node's is the host's).
var flannelChains = []string{"FLANNEL-FWD", "FLANNEL-POSTRTG"}

// forwardPolicy is the filter table's FORWARD policy in an iptables-save
// output ("" if it has none).
func forwardPolicy(save string) string {
	table := ""
	for _, line := range strings.Split(save, "\n") {
		if strings.HasPrefix(line, "*") {
			table = line[1:]
		}
		if f := strings.Fields(line); table == "filter" && len(f) >= 2 && f[0] == ":FORWARD" {
			return f[1]
		}
	}
	return ""
}

// restoreForwardPolicy sets back each flavour's FORWARD policy that
// changed (flanneld on the first node sets ACCEPT).
func restoreForwardPolicy(before map[string]string) []error {
	var errs []error
	for f, want := range before {
		if want == "" {
			continue
		}
		save, err := iptablesSave(f)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if got := forwardPolicy(save); got != "" && got != want {
			if out, err := exec.Command(f, "-t", "filter", "-P", "FORWARD", want).CombinedOutput(); err != nil {
				errs = append(errs, fmt.Errorf("%s -P FORWARD %s: %w: %s", f, want, err, out))
			}
		}
	}
	return errs
}

// Worker is a further node of the first node's cluster.
type Worker struct {
	// Name is its Node name; Dir its files on the host, seen at the first
	// node's Dir inside its mount namespace.
	Name, Dir string
	// IP is its address on the cluster link; Subnet and Gateway its pod
	// network (its podCIDR and flannel lease).
	IP, Subnet, Gateway string
	// NetNS and MountNS are the files pinning its namespaces.
	NetNS, MountNS string

	first  *Node
	cgroup string
	hostIf string
	procs  []*childproc.Proc
	fwd    []*forwarder
}

// WorkerOptions shape a worker.
type WorkerOptions struct {
	// StartupTaint registers the node with the CNI startup taint.
	StartupTaint bool
	// Labels are the node's labels from its registration on, as a node
	// pool sets them (kubelet's --node-labels).
	Labels map[string]string
	// IstioCNI readies the worker for Istio's istio-cni before its kubelet
	// starts: its image, its run directory and its view of the host's
	// /proc (istioHostProc).
	IstioCNI *IstioCNI
}

// clusterLink is the host bridge the nodes meet on, made with the first
// worker.
type clusterLink struct {
	Bridge string
	// Prefix is its subnet; HostIP the first node's address on it.
	Prefix netip4
	HostIP string
	next   int
}

// netip4 is an IPv4 /24 by its first three bytes.
type netip4 [3]byte

func (p netip4) addr(host int) string {
	return fmt.Sprintf("%d.%d.%d.%d", p[0], p[1], p[2], host)
}

// host returns rel under the worker's directory on the host; ns the same
// file as the worker's processes name it.
func (w *Worker) host(rel ...string) string {
	return filepath.Join(append([]string{w.Dir, "root"}, rel...)...)
}

func (w *Worker) ns(rel ...string) string {
	return filepath.Join(append([]string{w.first.Dir}, rel...)...)
}

// workerHostPaths are the fixed host paths a kubelet and a containerd
// write, made private to each worker's mount namespace.
var workerHostPaths = []string{"/var/lib/kubelet", "/var/log/containers", "/var/log/pods", "/var/lib/cni", "/run/containerd"}

// AddWorker starts a further node in the cluster and waits until it is
// Ready with flannel's network on it. The first call sets up the cluster
// link and flannel on the first node.
func (n *Node) AddWorker(ctx context.Context, o WorkerOptions) (w *Worker, err error) {
	if n.opts.Layout != LayoutGeneric {
		// A worker copies the generic layout's plugins and conflist.
		return nil, fmt.Errorf("a worker joins a node of the generic layout only, not %q", n.opts.Layout)
	}
	flannel, err := toolPath(n.Tools.Repo, "flannel")
	if err != nil {
		return nil, fmt.Errorf("flannel not built (hack/kube-tools.sh flannel): %w", err)
	}
	if err := n.clusterLinkUp(ctx, flannel); err != nil {
		return nil, err
	}
	short := randHex(4)
	w = &Worker{first: n, Name: n.Name + "-" + short}
	w.Dir = filepath.Join(n.Dir, "workers", short)
	w.cgroup = filepath.Base(n.Dir) + "-" + short
	n.workers = append(n.workers, w)
	defer func() {
		if err != nil {
			err = errors.Join(err, w.Down())
		}
	}()
	n.logf("== node %s joins", w.Name)
	if err := w.namespaces(); err != nil {
		return w, err
	}
	if err := w.files(ctx); err != nil {
		return w, err
	}
	if err := w.cgroups(); err != nil {
		return w, err
	}
	for _, port := range []int{n.APIPort, registryPort(n.Images.Registry)} {
		f, err := startForwarder(w.NetNS, port)
		if err != nil {
			return w, err
		}
		w.fwd = append(w.fwd, f)
	}
	if err := w.startContainerd(ctx); err != nil {
		return w, err
	}
	if err := w.importImages(ctx, o); err != nil {
		return w, err
	}
	if o.IstioCNI != nil {
		if err := w.readyForIstioCNI(ctx, o.IstioCNI); err != nil {
			return w, err
		}
	}
	if err := w.startKubelet(ctx, o); err != nil {
		return w, err
	}
	if err := n.setPodCIDR(ctx, w.Name, w.Subnet); err != nil {
		return w, err
	}
	if err := w.startFlannel(ctx, flannel); err != nil {
		return w, err
	}
	if err := n.waitNodeReady(ctx, w.Name); err != nil {
		return w, err
	}
	n.logf("   node %s Ready at %s, pods on %s", w.Name, w.IP, w.Subnet)
	return w, nil
}

// registryPort is the port of a host:port.
func registryPort(hostport string) int {
	_, p, _ := net.SplitHostPort(hostport)
	port, _ := strconv.Atoi(p)
	return port
}

// clusterLinkUp makes the cluster link and runs flannel on the first node,
// once.
func (n *Node) clusterLinkUp(ctx context.Context, flannel string) error {
	if n.link != nil {
		return nil
	}
	p, err := pickSubnet()
	if err != nil {
		return err
	}
	a := p.Addr().As4()
	l := &clusterLink{Bridge: "anodec" + randHex(5), Prefix: netip4{a[0], a[1], a[2]}, next: 2}
	l.HostIP = l.Prefix.addr(1)
	n.st.Links = append(n.st.Links, l.Bridge)
	if err := n.saveState(); err != nil {
		return err
	}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: l.Bridge}}
	if err := netlink.LinkAdd(br); err != nil {
		return fmt.Errorf("cluster link %s: %w", l.Bridge, err)
	}
	addr, _ := netlink.ParseAddr(l.HostIP + "/24")
	if err := netlink.AddrAdd(br, addr); err != nil {
		return fmt.Errorf("cluster link address: %w", err)
	}
	if err := netlink.LinkSetUp(br); err != nil {
		return err
	}
	n.link = l
	// The egress guard lets the first node and its pods reach the other
	// nodes and their pods, and nothing more.
	if err := n.guardAllow(p.String()); err != nil {
		return err
	}
	if err := n.setPodCIDR(ctx, n.Name, n.Subnet); err != nil {
		return err
	}
	dir := filepath.Join(n.Dir, "flannel")
	if err := writeFlannelConf(dir); err != nil {
		return err
	}
	args := flannelArgs(dir, n.Kubeconfig, l.Bridge, l.HostIP)
	pr, err := childproc.Start("flanneld", flannel, args, []string{"NODE_NAME=" + n.Name}, filepath.Join(n.Dir, "flanneld.log"))
	if err != nil {
		return err
	}
	n.procs = append(n.procs, pr)
	// The first node's conflist predates flannel: its lease is the
	// node's subnet, so the two agree.
	env, err := n.waitSubnetEnv(ctx, filepath.Join(dir, "subnet.env"))
	if err != nil {
		return err
	}
	if got := env["FLANNEL_SUBNET"]; got != n.Gateway+"/24" {
		return fmt.Errorf("flannel leased %s to the first node, its pods are on %s", got, n.Subnet)
	}
	return nil
}

// writeFlannelConf writes flannel's net-conf.json: host-gw routes each
// node's pod subnet via that node's address on the shared link.
func writeFlannelConf(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	conf := fmt.Sprintf(`{"Network": %q, "EnableIPv4": true, "Backend": {"Type": "host-gw"}}`+"\n", FlannelNetwork)
	return os.WriteFile(filepath.Join(dir, "net-conf.json"), []byte(conf), 0o644)
}

func flannelArgs(dir, kubeconfig, iface, ip string) []string {
	return []string{
		"--kubeconfig-file=" + kubeconfig,
		"--net-config-path=" + filepath.Join(dir, "net-conf.json"),
		"--subnet-file=" + filepath.Join(dir, "subnet.env"),
		"--iface=" + iface,
		"--public-ip=" + ip,
		// Pods keep their addresses across nodes: the mesh sees the
		// source pod, as on a flannel cluster without masquerading.
		"--ip-masq=false",
	}
}

// waitSubnetEnv waits for flannel's subnet file and returns its variables.
func (n *Node) waitSubnetEnv(ctx context.Context, path string) (map[string]string, error) {
	env := map[string]string{}
	err := n.poll(ctx, "flannel's lease in "+path, n.opts.Wait, func(context.Context) (bool, error) {
		b, err := os.ReadFile(path)
		if err != nil {
			return false, err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, "="); ok {
				env[k] = v
			}
		}
		return env["FLANNEL_SUBNET"] != "", nil
	})
	return env, err
}

// setPodCIDR sets a Node's spec.podCIDR, as kube-controller-manager's
// node IPAM does (disabled here: the first node's pods predate it).
func (n *Node) setPodCIDR(ctx context.Context, name, cidr string) error {
	patch := fmt.Sprintf(`{"spec":{"podCIDR":%q,"podCIDRs":[%q]}}`, cidr, cidr)
	return n.poll(ctx, "podCIDR of "+name, n.opts.Wait, func(ctx context.Context) (bool, error) {
		_, err := n.Client.CoreV1().Nodes().Patch(ctx, name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{})
		return err == nil, err
	})
}

// waitNodeReady waits until a Node is Ready.
func (n *Node) waitNodeReady(ctx context.Context, name string) error {
	return n.poll(ctx, "node "+name+" Ready", n.opts.Wait, func(ctx context.Context) (bool, error) {
		node, err := n.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				if c.Status == corev1.ConditionTrue {
					return true, nil
				}
				return false, fmt.Errorf("node %s not ready: %s", name, c.Message)
			}
		}
		return false, nil
	})
}

// guardAllow lets the node's processes and pods reach prefix through the
// egress guard (the other nodes of the cluster and their pods).
func (n *Node) guardAllow(prefix string) error {
	for _, rule := range [][]string{
		{"output", "ip", "daddr", prefix, "accept"},
		{"forward", "ip", "daddr", prefix, "accept"},
	} {
		args := append([]string{"insert", "rule", "inet", n.st.Guard}, rule...)
		if out, err := exec.Command("nft", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("nft %s: %w: %s", strings.Join(args, " "), err, out)
		}
	}
	return nil
}

// namespaces makes the worker's network and mount namespaces and its
// veth on the cluster link.
func (w *Worker) namespaces() error {
	n := w.first
	l := n.link
	nsDir := filepath.Join(w.Dir, "ns")
	w.NetNS, w.MountNS = filepath.Join(nsDir, "net"), filepath.Join(nsDir, "mnt")
	if err := os.MkdirAll(nsDir, 0o755); err != nil {
		return err
	}
	for _, f := range []string{w.NetNS, w.MountNS} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			return err
		}
	}
	// The worker's tree mirrors the first node's paths it uses.
	netns, err := filepath.Rel(n.Dir, n.NetnsDir)
	if err != nil {
		return err
	}
	for _, d := range []string{netns, "run", "state", "cni", "kubelet", "kube", "pod-logs", "flannel"} {
		if err := os.MkdirAll(w.host(d), 0o755); err != nil {
			return err
		}
	}
	// The fixed host paths first: their private dirs are named by host
	// paths the mount over the first node's directory then hides.
	// The first node's mounts below its directory (its pods' netns files
	// and their shared parent, kubelet's root) are not the worker's: a
	// private copy of the netns dir under the worker's shared one would
	// make the runtime refuse the agent's HostToContainer mount.
	script := []string{"ip link set lo up",
		`awk -v d="` + n.Dir + `/" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r | while read -r m; do umount -l "$m"; done`}
	for _, p := range workerHostPaths {
		priv := w.host("host", strings.ReplaceAll(strings.TrimPrefix(p, "/"), "/", "_"))
		if err := os.MkdirAll(priv, 0o755); err != nil {
			return err
		}
		// The mount point on the host; Down removes it if Up did not find it.
		if err := os.MkdirAll(p, 0o755); err != nil {
			return err
		}
		script = append(script, "mount --bind "+priv+" "+p)
	}
	// As on the first node: pod netns files propagate into the agent's
	// HostToContainer mount.
	script = append(script, "mount --bind "+w.host()+" "+n.Dir,
		"mount --bind "+n.NetnsDir+" "+n.NetnsDir, "mount --make-shared "+n.NetnsDir)
	cmd := exec.Command("unshare", "--net="+w.NetNS, "--mount="+w.MountNS, "--propagation", "private", "sh", "-ec", strings.Join(script, "\n"))
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("worker namespaces: %w: %s", err, out)
	}
	// Its veth: one end on the cluster link, the other its only way out.
	w.IP = l.Prefix.addr(l.next)
	l.next++
	w.hostIf = "anodew" + randHex(5)
	n.st.Links = append(n.st.Links, w.hostIf)
	if err := n.saveState(); err != nil {
		return err
	}
	f, err := os.Open(w.NetNS)
	if err != nil {
		return err
	}
	defer f.Close()
	br, err := netlink.LinkByName(l.Bridge)
	if err != nil {
		return err
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: w.hostIf, MasterIndex: br.Attrs().Index}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(f.Fd()))}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("worker veth: %w", err)
	}
	if err := netlink.LinkSetUp(veth); err != nil {
		return err
	}
	for _, c := range [][]string{{"ip", "addr", "add", w.IP + "/24", "dev", "eth0"}, {"ip", "link", "set", "eth0", "up"}} {
		if out, err := w.nsExec(context.Background(), c...); err != nil {
			return fmt.Errorf("%s: %w: %s", strings.Join(c, " "), err, out)
		}
	}
	// Its pod subnet: another free /24 of flannel's network.
	for {
		s, err := pickSubnet()
		if err != nil {
			return err
		}
		if s.String() != n.Subnet && !slices.ContainsFunc(n.workers, func(o *Worker) bool { return o.Subnet == s.String() }) {
			w.Subnet, w.Gateway = s.String(), s.Addr().Next().String()
			break
		}
	}
	return n.guardAllow(w.Subnet)
}

// nsExec runs a command in the worker's namespaces.
func (w *Worker) nsExec(ctx context.Context, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + w.NetNS, "--mount=" + w.MountNS, "--"}, args...)...).CombinedOutput()
	return string(out), err
}

// start starts a daemon of the worker in its namespaces.
func (w *Worker) start(name, bin string, args, env []string) error {
	p, err := childproc.Start(name+"@"+w.Name, "nsenter", append([]string{"--net=" + w.NetNS, "--mount=" + w.MountNS, "--", bin}, args...), env, filepath.Join(w.Dir, name+".log"))
	if err != nil {
		return err
	}
	w.procs = append(w.procs, p)
	w.first.procs = append(w.first.procs, p)
	return nil
}

// files copies what the worker's processes read from the first node's
// directory (hidden in their mount namespace) to the same paths in its
// own: the CA, the CNI plugins, the registry's hosts.toml.
func (w *Worker) files(_ context.Context) error {
	n := w.first
	copies := []string{n.Kube.CAFile}
	for _, p := range []string{"bridge", "host-local", "loopback"} {
		copies = append(copies, filepath.Join(n.CNIBinDir, p))
	}
	hosts, _ := filepath.Glob(filepath.Join(n.registryHostsDir(), "*", "hosts.toml"))
	copies = append(copies, hosts...)
	for _, src := range copies {
		rel, err := filepath.Rel(n.Dir, src)
		if err != nil || strings.HasPrefix(rel, "..") {
			return fmt.Errorf("%s is not in the node's directory", src)
		}
		if err := os.MkdirAll(filepath.Dir(w.host(rel)), 0o755); err != nil {
			return err
		}
		if err := atomicfile.CopyFile(src, w.host(rel), atomicfile.Options{Mode: 0o755}); err != nil {
			return err
		}
	}
	for _, d := range []string{n.CNIConfDir, n.AgentSocketDir(), n.AgentStateDir(), n.ZtunnelSocketDir()} {
		rel, _ := filepath.Rel(n.Dir, d)
		if err := os.MkdirAll(w.host(rel), 0o755); err != nil {
			return err
		}
	}
	return nil
}

// cgroups makes the worker's kubelet cgroup root in every hierarchy, so
// its kubepods never meet the first node's.
func (w *Worker) cgroups() error {
	mounts, err := cgroupMounts()
	if err != nil {
		return err
	}
	n := w.first
	for _, m := range mounts {
		d := filepath.Join(m, w.cgroup)
		n.st.WorkerCgroups = append(n.st.WorkerCgroups, d)
		if err := n.saveState(); err != nil {
			return err
		}
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("cgroup %s: %w", d, err)
		}
		// A new cpuset starts empty; its tasks could run nowhere.
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if b, err := os.ReadFile(filepath.Join(m, f)); err == nil {
				if err := os.WriteFile(filepath.Join(d, f), b, 0o644); err != nil {
					return fmt.Errorf("cgroup %s: %w", filepath.Join(d, f), err)
				}
			}
		}
	}
	return nil
}

// startContainerd runs containerd with the first node's configuration:
// every path in it is the worker's own in its mount namespace.
func (w *Worker) startContainerd(ctx context.Context) error {
	n := w.first
	rel, _ := filepath.Rel(n.Dir, filepath.Join(n.Dir, "containerd", "config.toml"))
	if err := os.WriteFile(w.host(rel), []byte(n.containerdConfig()), 0o600); err != nil {
		return err
	}
	env := []string{"PATH=" + filepath.Dir(n.Tools.Containerd) + string(os.PathListSeparator) + os.Getenv("PATH")}
	if err := w.start("containerd", n.Tools.Containerd, []string{"--config", w.ns(rel), "--log-level", "info"}, env); err != nil {
		return err
	}
	return n.poll(ctx, "containerd of "+w.Name, n.opts.Wait, func(ctx context.Context) (bool, error) {
		_, err := w.crictl(ctx, "version")
		return err == nil, err
	})
}

// crictl runs crictl against the worker's containerd.
func (w *Worker) crictl(ctx context.Context, args ...string) (string, error) {
	return runCrictlVia(ctx, []string{"nsenter", "--net=" + w.NetNS, "--mount=" + w.MountNS, "--"}, w.first.Tools.Crictl, w.first.ContainerdSocket, args...)
}

// importImages copies the first node's local images (pause, app, the
// stand-in, istio-cni's when asked) into the worker's containerd; the
// agent's it pulls from the registry, as the first node does.
func (w *Worker) importImages(ctx context.Context, o WorkerOptions) error {
	n := w.first
	archive := "images.tar"
	images := []string{n.Images.Pause, n.Images.App, n.Images.StandIn}
	if o.IstioCNI != nil {
		images = append(images, IstioCNIImage)
	}
	if _, err := n.ctr(ctx, append([]string{"images", "export", w.host(archive)}, images...)...); err != nil {
		return err
	}
	defer os.Remove(w.host(archive))
	out, err := w.nsExec(ctx, n.Tools.Ctr, "--address", n.ContainerdSocket, "--namespace", "k8s.io", "images", "import", w.ns(archive))
	if err != nil {
		return fmt.Errorf("import images into %s: %w: %s", w.Name, err, out)
	}
	return nil
}

// startKubelet runs the worker's kubelet: the first node's configuration,
// listening on the worker's address, with its own cgroup root.
func (w *Worker) startKubelet(ctx context.Context, o WorkerOptions) error {
	n := w.first
	cfg, err := n.Kube.UserConfig("system:node:"+w.Name, "system:nodes")
	if err != nil {
		return err
	}
	if err := kubeenv.WriteKubeconfig(cfg, w.host("kubelet", "kubeconfig")); err != nil {
		return err
	}
	conf := strings.Replace(n.kubeletConfig(10250, 10248), "address: 127.0.0.1\n", "address: "+w.IP+"\n", 1)
	if err := os.WriteFile(w.host("kubelet", "config.yaml"), []byte(conf), 0o600); err != nil {
		return err
	}
	for _, d := range [][]string{{"kubelet", "root"}, {"kubelet", "pki"}} {
		if err := os.MkdirAll(w.host(d...), 0o755); err != nil {
			return err
		}
	}
	args := []string{
		"--config=" + w.ns("kubelet", "config.yaml"),
		"--kubeconfig=" + w.ns("kubelet", "kubeconfig"),
		"--root-dir=" + w.ns("kubelet", "root"),
		"--cert-dir=" + w.ns("kubelet", "pki"),
		"--hostname-override=" + w.Name,
		"--node-ip=" + w.IP,
		"--cgroup-root=/" + w.cgroup,
		"--v=1",
	}
	if o.StartupTaint {
		args = append(args, "--register-with-taints="+nodetaint.Key+"=:"+string(nodetaint.Effect))
	}
	if len(o.Labels) > 0 {
		var labels []string
		for k, v := range o.Labels {
			labels = append(labels, k+"="+v)
		}
		slices.Sort(labels)
		args = append(args, "--node-labels="+strings.Join(labels, ","))
	}
	if err := w.start("kubelet", n.Tools.Kubelet, args, nil); err != nil {
		return err
	}
	return n.poll(ctx, "node "+w.Name+" registered", n.opts.Wait, func(ctx context.Context) (bool, error) {
		_, err := n.Client.CoreV1().Nodes().Get(ctx, w.Name, metav1.GetOptions{})
		return err == nil, err
	})
}

// startFlannel runs flanneld on the worker and writes its conflist on the
// lease, as flannel's CNI plugin delegates.
func (w *Worker) startFlannel(ctx context.Context, flannel string) error {
	n := w.first
	if err := writeFlannelConf(w.host("flannel")); err != nil {
		return err
	}
	// flanneld reads the admin kubeconfig at the first node's path.
	rel, _ := filepath.Rel(n.Dir, n.Kubeconfig)
	if err := atomicfile.CopyFile(n.Kubeconfig, w.host(rel), atomicfile.Options{Mode: 0o600}); err != nil {
		return err
	}
	if err := w.start("flanneld", flannel, flannelArgs(w.ns("flannel"), n.Kubeconfig, "eth0", w.IP), []string{"NODE_NAME=" + w.Name}); err != nil {
		return err
	}
	env, err := n.waitSubnetEnv(ctx, w.host("flannel", "subnet.env"))
	if err != nil {
		return err
	}
	if got := env["FLANNEL_SUBNET"]; got != w.Gateway+"/24" {
		return fmt.Errorf("flannel leased %s to %s, its podCIDR is %s", got, w.Name, w.Subnet)
	}
	b, err := bridgeConflist("cni0", w.Subnet, w.Gateway, w.ns("cni", "ipam"))
	if err != nil {
		return err
	}
	rel, _ = filepath.Rel(n.Dir, n.CNIConfFile)
	return os.WriteFile(w.host(rel), append(b, '\n'), 0o644)
}

// AppPod is the first node's app pod bound to the worker.
func (w *Worker) AppPod(namespace, name string, o AppOptions) *corev1.Pod {
	p := w.first.AppPod(namespace, name, o)
	p.Spec.NodeName = w.Name
	return p
}

// Down drains the worker's pods, stops its daemons and removes everything
// it made; the Node object goes too.
func (w *Worker) Down() error {
	n := w.first
	if w.Dir == "" {
		return nil
	}
	var errs []error
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if kl := w.proc("kubelet"); kl != nil && !kl.Exited() && n.Client != nil {
		if err := w.deletePods(ctx); err != nil {
			n.logf("   %s: %v (cleaning up below the API)", w.Name, err)
		}
	}
	for _, name := range []string{"kubelet", "flanneld", "containerd"} {
		if p := w.proc(name); p != nil {
			_ = p.Stop(15 * time.Second)
		}
	}
	n.procs = slices.DeleteFunc(n.procs, func(p *childproc.Proc) bool { return slices.Contains(w.procs, p) })
	w.procs = nil
	// Shims and containers outlive containerd: everything in the worker's
	// mount namespace goes, then its pods' cgroups.
	errs = append(errs, killNamespace(w.MountNS)...)
	for _, f := range w.fwd {
		f.stop()
	}
	w.fwd = nil
	for _, c := range n.st.WorkerCgroups {
		if filepath.Base(c) == w.cgroup {
			if _, err := os.Stat(c); err == nil {
				if err := removeCgroupTree(c); err != nil {
					errs = append(errs, err)
				}
			}
		}
	}
	// The machine is gone: its Node goes (kubelet no longer re-registers
	// it), and with it the DaemonSets' pods there.
	if n.Client != nil {
		if err := n.Client.CoreV1().Nodes().Delete(ctx, w.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			errs = append(errs, fmt.Errorf("delete node %s: %w", w.Name, err))
		}
		if err := w.forgetPods(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if err := unmountUnder(filepath.Join(w.Dir, "ns")); err != nil {
		errs = append(errs, err)
	}
	if l, err := netlink.LinkByName(w.hostIf); err == nil {
		if err := netlink.LinkDel(l); err != nil && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("delete %s: %w", w.hostIf, err))
		}
	}
	if len(errs) == 0 {
		if err := os.RemoveAll(w.Dir); err != nil {
			errs = append(errs, err)
		}
	}
	n.workers = slices.DeleteFunc(n.workers, func(o *Worker) bool { return o == w })
	w.Dir = ""
	return errors.Join(errs...)
}

func (w *Worker) proc(name string) *childproc.Proc {
	for _, p := range w.procs {
		if p.Name == name+"@"+w.Name {
			return p
		}
	}
	return nil
}

// deletePods deletes every pod bound to the worker but the DaemonSets'
// (which would come back) and waits until kubelet has stopped them, their
// CNI DEL run; the DaemonSets' pods go with the Node.
func (w *Worker) deletePods(ctx context.Context) error {
	gone, err := w.deleteBoundPods(ctx, 1, true)
	if err != nil {
		return err
	}
	for _, p := range gone {
		if err := w.first.WaitPodGone(ctx, p.Namespace, p.Name); err != nil {
			return err
		}
	}
	return nil
}

// forgetPods removes the API objects of the pods still bound to the
// deleted worker (its DaemonSets' pods), as the pod garbage collector
// does for a Node that is gone.
func (w *Worker) forgetPods(ctx context.Context) error {
	_, err := w.deleteBoundPods(ctx, 0, false)
	return err
}

// deleteBoundPods deletes the pods bound to the worker with the grace
// period given, the DaemonSets' aside when skipDaemonSets, and returns
// those it deleted.
func (w *Worker) deleteBoundPods(ctx context.Context, grace int64, skipDaemonSets bool) ([]corev1.Pod, error) {
	n := w.first
	l, err := n.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + w.Name})
	if err != nil {
		return nil, err
	}
	var deleted []corev1.Pod
	for _, p := range l.Items {
		if owner := metav1.GetControllerOf(&p); skipDaemonSets && owner != nil && owner.Kind == "DaemonSet" {
			continue
		}
		if err := n.Client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace}); err != nil && !apierrors.IsNotFound(err) {
			return nil, err
		}
		deleted = append(deleted, p)
	}
	return deleted, nil
}

// killNamespace kills every process in the mount namespace pinned at
// file, until none is left.
func killNamespace(file string) []error {
	var st unix.Stat_t
	if err := unix.Stat(file, &st); err != nil {
		return nil
	}
	want := fmt.Sprintf("mnt:[%d]", st.Ino)
	deadline := time.Now().Add(30 * time.Second)
	for {
		var pids []int
		des, _ := os.ReadDir("/proc")
		for _, de := range des {
			pid, err := strconv.Atoi(de.Name())
			if err != nil {
				continue
			}
			if l, err := os.Readlink("/proc/" + de.Name() + "/ns/mnt"); err == nil && l == want {
				pids = append(pids, pid)
			}
		}
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return []error{fmt.Errorf("processes %v of %s do not die", pids, file)}
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// forwarder listens on a loopback port inside a network namespace and
// carries each connection to the same port on the host's loopback: the
// first node's API server and registry, for a worker's processes that
// reach them at 127.0.0.1 as the first node's do. (startLoopbackProxy
// makes one in the host's own namespace, to another port.)
type forwarder struct {
	l net.Listener
	// target is the host address each connection is carried to.
	target string
	wg     sync.WaitGroup
	mu     sync.Mutex
	conns  map[net.Conn]bool
}

func startForwarder(netnsFile string, port int) (*forwarder, error) {
	target, err := ns.GetNS(netnsFile)
	if err != nil {
		return nil, err
	}
	defer target.Close()
	addr := "127.0.0.1:" + strconv.Itoa(port)
	f := &forwarder{target: addr, conns: map[net.Conn]bool{}}
	if err := target.Do(func(ns.NetNS) error {
		// The socket belongs to the namespace it was made in.
		f.l, err = net.Listen("tcp", addr)
		return err
	}); err != nil {
		return nil, fmt.Errorf("listen on %s in %s: %w", addr, netnsFile, err)
	}
	f.serve()
	return f, nil
}

// startLoopbackProxy carries each connection to 127.0.0.1:listen (0: any
// free port) to 127.0.0.1:target, in the host's network namespace.
func startLoopbackProxy(listen, target int) (*forwarder, error) {
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(listen))
	if err != nil {
		return nil, err
	}
	f := &forwarder{l: l, target: "127.0.0.1:" + strconv.Itoa(target), conns: map[net.Conn]bool{}}
	f.serve()
	return f, nil
}

// port is the port the forwarder listens on.
func (f *forwarder) port() int { return f.l.Addr().(*net.TCPAddr).Port }

// serve accepts connections until stop.
func (f *forwarder) serve() {
	f.wg.Add(1)
	go func() { // owner: f; stop closes the listener and waits
		defer f.wg.Done()
		for {
			c, err := f.l.Accept()
			if err != nil {
				return
			}
			f.wg.Add(1)
			go func() { // owner: f; stop closes c
				defer f.wg.Done()
				f.pipe(c)
			}()
		}
	}()
}

func (f *forwarder) track(c net.Conn, add bool) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.conns == nil {
		return false
	}
	if add {
		f.conns[c] = true
	} else {
		delete(f.conns, c)
	}
	return true
}

func (f *forwarder) pipe(c net.Conn) {
	defer c.Close()
	up, err := net.Dial("tcp", f.target)
	if err != nil {
		return
	}
	defer up.Close()
	if !f.track(c, true) || !f.track(up, true) {
		return
	}
	defer f.track(c, false)
	defer f.track(up, false)
	done := make(chan struct{}, 2)
	go func() { // owner: pipe; waits on done
		_, _ = io.Copy(up, c)
		done <- struct{}{}
	}()
	go func() { // owner: pipe; waits on done
		_, _ = io.Copy(c, up)
		done <- struct{}{}
	}()
	<-done
	c.Close()
	up.Close()
	<-done
}

// stop closes the listener and every connection, and waits for the
// goroutines.
func (f *forwarder) stop() {
	_ = f.l.Close()
	f.mu.Lock()
	for c := range f.conns {
		_ = c.Close()
	}
	f.conns = nil
	f.mu.Unlock()
	f.wg.Wait()
}

// workerStandInPort is the worker stand-in's debug port on the worker's
// address (its own network: no other node's port to avoid).
const workerStandInPort = 15099

// StartStandIn runs a ztunnel stand-in on the worker, its debug endpoint
// on the worker's address, reachable from the first node over the link.
func (w *Worker) StartStandIn(ctx context.Context) error {
	return w.first.startStandInPod(ctx, StandInName+"-"+strings.TrimPrefix(w.Name, w.first.Name+"-"), w.Name, w.IP, workerStandInPort)
}

func (w *Worker) standInAddr() string { return net.JoinHostPort(w.IP, strconv.Itoa(workerStandInPort)) }

// StandInRecords returns every connection the worker's stand-in proxied.
func (w *Worker) StandInRecords(ctx context.Context) ([]ztunnel.Record, error) {
	return standInGetAt[[]ztunnel.Record](ctx, w.standInAddr(), "/records")
}

// StandInWorkloads returns the pods the worker's stand-in serves.
func (w *Worker) StandInWorkloads(ctx context.Context) ([]ztunnel.Workload, error) {
	return standInGetAt[[]ztunnel.Workload](ctx, w.standInAddr(), "/workloads")
}

// SetStandInRemote tells the stand-in at addr which captured pods other
// nodes serve (their traffic takes the tunnel), as istiod tells ztunnel.
func setStandInRemote(ctx context.Context, addr string, ips []string) error {
	b, err := json.Marshal(ips)
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, "http://"+addr+"/remote", bytes.NewReader(b))
	if err != nil {
		return err
	}
	resp, err := noKeepAlive.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		return fmt.Errorf("PUT %s/remote: %s", addr, resp.Status)
	}
	return nil
}

// SetStandInRemote tells the first node's stand-in the other nodes'
// captured pods.
func (n *Node) SetStandInRemote(ctx context.Context, ips []string) error {
	return setStandInRemote(ctx, fmt.Sprintf("127.0.0.1:%d", n.standInPort), ips)
}

// SetStandInRemote tells the worker's stand-in the other nodes' captured
// pods.
func (w *Worker) SetStandInRemote(ctx context.Context, ips []string) error {
	return setStandInRemote(ctx, w.standInAddr(), ips)
}

// servedBy checks a pod is enrolled in the API (annotation) and served by
// a stand-in with its three listeners.
func servedBy(ctx context.Context, n *Node, p *corev1.Pod, wls []ztunnel.Workload) (bool, error) {
	cur, err := n.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	if v := cur.Annotations[ambient.RedirectionAnnotation]; v != ambient.RedirectionEnabled {
		return false, fmt.Errorf("annotation %s=%q", ambient.RedirectionAnnotation, v)
	}
	for _, wl := range wls {
		if wl.UID == string(p.UID) {
			for _, port := range []int{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort, ambient.ZtunnelInboundHBONEPort} {
				if !slices.Contains(wl.Ports, port) {
					return false, fmt.Errorf("stand-in has no listener on %d in it", port)
				}
			}
			return true, nil
		}
	}
	return false, errors.New("the stand-in does not serve it")
}

// Captured is true when a pod of the worker is enrolled (annotation) and
// served by the worker's stand-in.
func (w *Worker) Captured(ctx context.Context, p *corev1.Pod) (bool, error) {
	wls, err := w.StandInWorkloads(ctx)
	if err != nil {
		return false, err
	}
	return servedBy(ctx, w.first, p, wls)
}

// Captured is Worker.Captured for a pod of the first node.
func (n *Node) Captured(ctx context.Context, p *corev1.Pod) (bool, error) {
	wls, err := n.StandInWorkloads(ctx)
	if err != nil {
		return false, err
	}
	return servedBy(ctx, n, p, wls)
}

// PodNetns returns a file of the network namespace of a worker pod's ready
// sandbox that the host can open: its pause process's. The file the
// runtime made is a mount inside the worker's mount namespace.
func (w *Worker) PodNetns(ctx context.Context, namespace, name string) (string, error) {
	id, err := sandboxID(ctx, w.crictl, namespace, name)
	if err != nil {
		return "", err
	}
	return w.sandboxNetns(ctx, id)
}

// sandboxNetns is PodNetns by sandbox id.
func (w *Worker) sandboxNetns(ctx context.Context, id string) (string, error) {
	out, err := w.crictl(ctx, "inspectp", "-o", "json", id)
	if err != nil {
		return "", fmt.Errorf("inspectp %s: %w: %s", id, err, out)
	}
	var info struct{ Info struct{ Pid int } }
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		return "", fmt.Errorf("inspectp %s: %w", id, err)
	}
	if info.Info.Pid <= 0 {
		return "", fmt.Errorf("sandbox %s has no process", id)
	}
	return fmt.Sprintf("/proc/%d/ns/net", info.Info.Pid), nil
}

// captured is Node.captured for a pod of the worker: enrolled, rules in
// its netns, served by the worker's stand-in.
func (w *Worker) captured(ctx context.Context, p *corev1.Pod) (bool, error) {
	netns, err := w.PodNetns(ctx, p.Namespace, p.Name)
	if err != nil {
		return false, err
	}
	rules, err := NetnsRules(ctx, netns)
	if err != nil {
		return false, err
	}
	if !HasCaptureRules(rules) {
		return false, errors.New("no capture rules in its netns")
	}
	return w.Captured(ctx, p)
}

// AgentState returns the pods the worker's agent has enrolled, from its
// debug socket (a file of the worker's tree on the host).
func (w *Worker) AgentState(ctx context.Context) ([]AgentPod, error) {
	rel, err := filepath.Rel(w.first.Dir, w.first.AgentDebugSocket())
	if err != nil {
		return nil, err
	}
	c := &http.Client{Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", w.host(rel))
		},
	}}
	b, err := httpGetWith(ctx, c, "http://agent/debug/pods")
	if err != nil {
		return nil, err
	}
	var pods []AgentPod
	if err := json.Unmarshal(b, &pods); err != nil {
		return nil, fmt.Errorf("decode /debug/pods: %w: %s", err, b)
	}
	return pods, nil
}

// Cordon sets the worker's Node unschedulable (or schedulable again), as
// kubectl cordon and uncordon do.
func (w *Worker) Cordon(ctx context.Context, on bool) error {
	patch := fmt.Sprintf(`{"spec":{"unschedulable":%v}}`, on)
	_, err := w.first.Client.CoreV1().Nodes().Patch(ctx, w.Name, types.StrategicMergePatchType, []byte(patch), metav1.PatchOptions{})
	return err
}

// Drain cordons the worker and deletes its pods but the DaemonSets', as
// kubectl drain --ignore-daemonsets does, waiting until they are gone.
func (w *Worker) Drain(ctx context.Context) error {
	if err := w.Cordon(ctx, true); err != nil {
		return err
	}
	n := w.first
	l, err := n.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + w.Name})
	if err != nil {
		return err
	}
	var gone []corev1.Pod
	for _, p := range l.Items {
		if owner := metav1.GetControllerOf(&p); owner != nil && owner.Kind == "DaemonSet" {
			continue
		}
		if p.Namespace == ReleaseNamespace && strings.HasPrefix(p.Name, StandInName) {
			continue // the node's ztunnel, a DaemonSet pod on a real cluster
		}
		if err := n.Client.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return err
		}
		gone = append(gone, p)
	}
	for _, p := range gone {
		if err := n.WaitPodGone(ctx, p.Namespace, p.Name); err != nil {
			return err
		}
	}
	return nil
}
