package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/procstat"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The peer column is Istio's own istio-cni (install-cni and its CNI
// plugin) as hack/kube-tools.sh builds it from Istio's source, with the
// chart of the same source (the tool directory's chart/): the default
// minor's, or the one AMBIENT_ISTIO names.
const (
	// istioNamespace and istioRelease are the chart's release, as
	// istioctl and the docs install it.
	istioNamespace = "istio-system"
	istioRelease   = "istio-cni"
	// istioReadyURL is the DaemonSet's readiness probe (port 8000 is fixed
	// in install-cni).
	istioReadyURL  = "http://127.0.0.1:" + istioReadyPort + "/readyz"
	istioReadyPort = "8000"
	// istioMetricsURL is its monitoring port (the chart's 15014).
	istioMetricsURL = "http://127.0.0.1:15014"
)

// IstioTool is the tools cache's directory of Istio's install-cni,
// istio-cni plugin and chart (hack/kube-tools.sh istio-cni).
func IstioTool() string { return kubeenv.IstioTool("istio-cni") }

// istioUser is istio-cni's ServiceAccount (the chart's), as the API
// server's audit log names it; install-cni and its plugin both use it.
var istioUser = "system:serviceaccount:" + istioNamespace + ":" + istioRelease

// Peer is one way of running Istio's istio-cni beside ours.
type Peer struct {
	Name string
	// NativeNftables is the chart's global.nativeNftables.
	NativeNftables bool
}

// Peers are istio-cni's runs: its default iptables mode and its native
// nftables mode.
func Peers() []Peer {
	return []Peer{{Name: "istio-cni"}, {Name: "istio-cni-nftables", NativeNftables: true}}
}

// IstioBinaries finds install-cni, the istio-cni plugin and Istio's
// istio-cni chart (chart/) in the directory named by
// AMBIENT_TOOL_ISTIO_CNI, else in the tools cache where hack/kube-tools.sh
// builds them, and the Istio version they are built from.
func IstioBinaries(root string) (installCNI, plugin, chart, version string, err error) {
	dir := os.Getenv("AMBIENT_TOOL_ISTIO_CNI")
	if dir == "" {
		out, err := exec.Command("bash", filepath.Join(root, "hack", "kube-tools.sh"), "--path", IstioTool()).Output()
		if err != nil {
			return "", "", "", "", fmt.Errorf("hack/kube-tools.sh --path %s: %w", IstioTool(), err)
		}
		dir = strings.TrimSpace(string(out))
		// make check builds it beside make test, in node-tools.
		kubeenv.AwaitTool(filepath.Base(dir), dir, func(format string, args ...any) {
			fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
		})
	}
	version = kubeenv.IstioVersion(dir)
	installCNI, plugin, chart = filepath.Join(dir, "install-cni"), filepath.Join(dir, "istio-cni"), filepath.Join(dir, "chart")
	for _, p := range []string{installCNI, plugin, filepath.Join(chart, "Chart.yaml")} {
		if st, err := os.Stat(p); err != nil || st.IsDir() {
			return "", "", "", "", fmt.Errorf("%s is not built (hack/kube-tools.sh %s builds it; or set AMBIENT_TOOL_ISTIO_CNI to a directory holding install-cni, istio-cni and chart/)", p, IstioTool())
		}
	}
	return installCNI, plugin, chart, version, nil
}

// istioChart is what Istio's chart, rendered with its ambient profile,
// runs on a node.
type istioChart struct {
	// Env is the install-cni container's environment (the ConfigMap's
	// data, then the container's own entries), with the downward-API
	// fields left for the node to fill.
	Env      map[string]string
	FieldEnv map[string]string // name → fieldPath or resource
	Args     []string
	// RBAC is its ClusterRoles, for its ServiceAccount.
	RBAC           []byte
	ServiceAccount string
	Manifest       []byte
}

// renderIstioChart renders Istio's istio-cni chart (a directory) with
// helm, as `helm install istio-cni ... --set profile=ambient` does.
// The agents here run as host processes in the node's network namespace,
// so ambient.shareHostNetworkNamespace is set: the chart's own setting for
// a DaemonSet on the host network.
func renderIstioChart(ctx context.Context, chart string, nativeNft bool) (*istioChart, error) {
	helm, err := kubeenv.ToolPath(kubeenv.Helm)
	if err != nil {
		return nil, err
	}
	args := []string{"template", istioRelease, chart, "--namespace", istioNamespace, "--set", "profile=ambient",
		"--set", "ambient.shareHostNetworkNamespace=true", "--set", "global.nativeNftables=" + strconv.FormatBool(nativeNft)}
	manifest, err := exec.CommandContext(ctx, helm, args...).Output()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return nil, fmt.Errorf("helm %s: %w: %s", strings.Join(args, " "), err, ee.Stderr)
		}
		return nil, fmt.Errorf("helm %s: %w", strings.Join(args, " "), err)
	}
	c := &istioChart{Env: map[string]string{}, FieldEnv: map[string]string{}, Manifest: manifest}
	var ds *appsv1.DaemonSet
	var cm *corev1.ConfigMap
	for doc := range strings.SplitSeq(string(manifest), "\n---") {
		var meta struct{ Kind string }
		if yaml.Unmarshal([]byte(doc), &meta) != nil {
			continue
		}
		switch meta.Kind {
		case "DaemonSet":
			ds = &appsv1.DaemonSet{}
			if err := yaml.Unmarshal([]byte(doc), ds); err != nil {
				return nil, fmt.Errorf("istio-cni DaemonSet: %w", err)
			}
		case "ConfigMap":
			cm = &corev1.ConfigMap{}
			if err := yaml.Unmarshal([]byte(doc), cm); err != nil {
				return nil, fmt.Errorf("istio-cni ConfigMap: %w", err)
			}
		}
	}
	if ds == nil || cm == nil || len(ds.Spec.Template.Spec.Containers) != 1 {
		return nil, errors.New("the Istio chart rendered no DaemonSet with one container and ConfigMap")
	}
	ctr := ds.Spec.Template.Spec.Containers[0]
	for _, ef := range ctr.EnvFrom {
		if ef.ConfigMapRef == nil || ef.ConfigMapRef.Name != cm.Name {
			return nil, fmt.Errorf("the DaemonSet reads an environment source the harness does not know: %+v", ef)
		}
	}
	for k, v := range cm.Data {
		c.Env[k] = v
	}
	for _, e := range ctr.Env {
		switch {
		case e.ValueFrom == nil:
			c.Env[e.Name] = e.Value
		case e.ValueFrom.FieldRef != nil:
			c.FieldEnv[e.Name] = e.ValueFrom.FieldRef.FieldPath
		case e.ValueFrom.ResourceFieldRef != nil:
			c.FieldEnv[e.Name] = e.ValueFrom.ResourceFieldRef.Resource
		default:
			return nil, fmt.Errorf("the DaemonSet's %s comes from a source the harness does not know", e.Name)
		}
	}
	c.Args = append(slices.Clone(ctr.Command[1:]), ctr.Args...)
	c.ServiceAccount = ds.Spec.Template.Spec.ServiceAccountName
	if c.RBAC, err = kubeenv.ExtractRoles(manifest); err != nil {
		return nil, fmt.Errorf("the Istio chart RBAC: %w", err)
	}
	return c, nil
}

// istioNode is Istio's install-cni on a simulated node of its own: its
// container's view (the chart's hostPath mounts under /host, its
// ServiceAccount files, /var/run/ztunnel) is a root on a tmpfs in a mount
// namespace of its own, in the node's (the benchmark's) network namespace.
type istioNode struct {
	Name, Dir, BinDir, ConfDir, RunDir, ZDSSocket, LogPath, Bridge string
	// NetnsDir is a shared mount the pods' namespaces are bound in: its
	// copy in install-cni's mount namespace sees them.
	NetnsDir string
	Env      map[string]string
	Args     []string // install-cni's, the chart's
	Primary  []byte
	// netns, when set, is the network namespace install-cni runs in;
	// readyURL is its readiness probe as reached from here.
	netns, readyURL string
	proc            *childproc.Proc // unshare, whose child install-cni is
	agentPid        int             // install-cni, PID 1 of its PID namespace
	shared          bool
}

// istioPlace says where one istio-cni node is: its API server, its
// directory, its name and the reference plugins its bin dir gets.
type istioPlace struct {
	env        *kubeenv.Env
	dir, name  string
	refPlugins string
	// apiHost, when set, is the API server's URL as the node reaches it
	// (default env's own).
	apiHost string
	// netns, when set, is a network namespace (a bind-mounted file)
	// install-cni runs in, as a node of its own; its readiness probe is
	// then asked at nodeIP.
	netns, nodeIP string
}

// prepareIstio prepares the node (CNI bin dir with the reference plugins,
// the primary conflist, the ServiceAccount under the chart's RBAC, the
// chart's environment) for start. Close undoes it.
func prepareIstio(ctx context.Context, at istioPlace, installCNI, plugin string, chart *istioChart) (n *istioNode, err error) {
	n = &istioNode{Args: chart.Args,
		Name: at.name, Dir: at.dir, BinDir: filepath.Join(at.dir, "bin"), ConfDir: filepath.Join(at.dir, "net.d"),
		RunDir: filepath.Join(at.dir, "run"), LogPath: filepath.Join(at.dir, "install-cni.log"),
		netns: at.netns, readyURL: istioReadyURL,
	}
	if at.nodeIP != "" {
		n.readyURL = "http://" + net.JoinHostPort(at.nodeIP, istioReadyPort) + "/readyz"
	}
	n.ZDSSocket = filepath.Join(at.dir, "ztunnel", "ztunnel.sock")
	n.NetnsDir = filepath.Join(at.dir, "netns")
	for _, d := range []string{n.BinDir, n.ConfDir, n.RunDir, filepath.Dir(n.ZDSSocket), filepath.Join(at.dir, "image"), filepath.Join(at.dir, "sa"), n.NetnsDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, err
		}
	}
	node := n
	defer func() {
		if err != nil {
			err = errors.Join(err, node.Close())
			n = nil
		}
	}()
	if err := unix.Mount(n.NetnsDir, n.NetnsDir, "", unix.MS_BIND, ""); err != nil {
		return n, fmt.Errorf("bind %s: %w", n.NetnsDir, err)
	}
	n.shared = true
	if err := unix.Mount("", n.NetnsDir, "", unix.MS_SHARED, ""); err != nil {
		return n, fmt.Errorf("make %s a shared mount: %w", n.NetnsDir, err)
	}
	for _, p := range cnibin.ReferencePlugins {
		b, err := os.ReadFile(filepath.Join(at.refPlugins, p))
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(n.BinDir, p), b, 0o755); err != nil {
			return nil, err
		}
	}
	// The image holds the plugin at /opt/cni/bin, where install-cni copies
	// it from, and install-cni itself.
	for src, dst := range map[string]string{plugin: "istio-cni", installCNI: "install-cni"} {
		b, err := os.ReadFile(src)
		if err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(at.dir, "image", dst), b, 0o755); err != nil {
			return nil, err
		}
	}
	n.Bridge = testnet.RandName("ic", 8)
	n.Primary = cnibin.Conflist(cnibin.Network{Bridge: n.Bridge, Subnet: istioSubnet, DataDir: filepath.Join(at.dir, "ipam")})
	if err := os.WriteFile(filepath.Join(n.ConfDir, "10-bridge.conflist"), n.Primary, 0o644); err != nil {
		return nil, err
	}
	cfg, err := at.env.ServiceAccountConfig(ctx, istioNamespace, chart.ServiceAccount, chart.RBAC)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(at.dir, "sa", "token"), []byte(cfg.BearerToken), 0o600); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(at.dir, "sa", "ca.crt"), cfg.CAData, 0o644); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(at.dir, "sa", "namespace"), []byte(istioNamespace), 0o644); err != nil {
		return nil, err
	}
	host := cfg.Host
	if at.apiHost != "" {
		host = at.apiHost
	}
	u, err := url.Parse(host)
	if err != nil {
		return nil, err
	}
	n.Env = map[string]string{}
	for k, v := range chart.Env {
		n.Env[k] = v
	}
	for k, f := range chart.FieldEnv {
		switch f {
		case "spec.nodeName":
			n.Env[k] = n.Name
		case "metadata.name":
			n.Env[k] = "istio-cni-node-" + testnet.RandName("", 5)
		case "metadata.namespace":
			n.Env[k] = istioNamespace
		case "limits.cpu":
			// No limit in the chart: the kubelet gives the node's CPUs.
			n.Env[k] = strconv.Itoa(runtime.NumCPU())
		case "limits.memory":
			mem, err := memTotal()
			if err != nil {
				return nil, err
			}
			n.Env[k] = strconv.FormatInt(mem, 10)
		default:
			return nil, fmt.Errorf("the DaemonSet's %s reads %s, which the harness does not fill", k, f)
		}
	}
	// Where things are: the plugin on the host reads the agent's run
	// directory (its socket, kubeconfig) at the path install-cni writes
	// into the conflist, so it must be the same inside and out.
	for k, v := range istioNodeLocal(n, u) {
		n.Env[k] = v
	}
	script := filepath.Join(at.dir, "start.sh")
	if err := os.WriteFile(script, []byte(istioStartScript), 0o755); err != nil {
		return nil, err
	}
	return n, nil
}

// start starts install-cni with the chart's environment, in a mount and
// PID namespace of its own; one must not be running.
func (n *istioNode) start(ctx context.Context) (err error) {
	args := append([]string{"unshare", "--mount", "--pid", "--fork", "--kill-child=SIGTERM", "--propagation", "slave",
		"sh", filepath.Join(n.Dir, "start.sh"), n.Dir, filepath.Join(n.Dir, "image", "install-cni")}, n.Args...)
	if n.netns != "" {
		// nsenter execs unshare: the process started stays unshare.
		args = append([]string{"nsenter", "--net=" + n.netns, "--"}, args...)
	}
	if n.proc, err = childproc.StartEnviron("istio install-cni", args[0], args[1:], simnode.Environ(n.Env), n.LogPath); err != nil {
		return err
	}
	n.agentPid = 0
	// install-cni is unshare's child (the script execs it).
	deadline := time.Now().Add(time.Minute)
	for n.agentPid == 0 {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", n.proc.Pid(), n.proc.Pid()))
		if f := strings.Fields(string(b)); len(f) == 1 {
			if comm, _ := os.ReadFile("/proc/" + f[0] + "/comm"); strings.TrimSpace(string(comm)) == "install-cni" {
				n.agentPid, _ = strconv.Atoi(f[0])
				break
			}
		}
		if n.proc.Exited() || time.Now().After(deadline) {
			return fmt.Errorf("the Istio install-cni did not start (%v); log tail:\n%s", n.proc.Err(), n.proc.LogTail(30))
		}
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

// istioSubnet is the istio-cni node's pod network, apart from ours.
var istioSubnet = netip.MustParsePrefix("10.96.0.0/16")

// istioNodeLocal are the settings the harness changes, all of them where
// things are: the API server (the pod's in-cluster service variables), the
// agent's run directory (shared with the plugin on the host) and PATH.
func istioNodeLocal(n *istioNode, api *url.URL) map[string]string {
	return map[string]string{
		"KUBERNETES_SERVICE_HOST": api.Hostname(),
		"KUBERNETES_SERVICE_PORT": api.Port(),
		"CNI_AGENT_RUN_DIR":       n.RunDir,
	}
}

// istioStartScript builds install-cni's container view and execs it, as
// PID 1 of a PID namespace of its own (so that /host/proc/1, which it reads
// as the node's, is in the node's network namespace): a tmpfs root with
// the host's /usr, /etc, /dev and /sys, the chart's hostPath mounts
// (/host/opt/cni/bin, /host/etc/cni/net.d, /host/proc read-only,
// /var/run/ztunnel), the pods' namespaces under /host at their own path,
// the ServiceAccount files and the node's directory at its own path; beside
// it a process named kubelet, as on a node. The namespaces go with the
// process.
const istioStartScript = `set -eu
D=$1; shift
BIN=$1; shift
R=$D/root
mkdir -p "$R"
mount -t tmpfs -o mode=0755 tmpfs "$R"
for d in usr etc dev sys; do mkdir -p "$R/$d"; mount --rbind "/$d" "$R/$d"; done
for l in bin lib lib32 lib64 libx32 sbin; do if [ -L "/$l" ]; then ln -s "$(readlink "/$l")" "$R/$l"; fi; done
mkdir -p "$R/proc" "$R/tmp" "$R/var" "$R/run/ztunnel" "$R/run/secrets/kubernetes.io/serviceaccount" \
  "$R/host/proc" "$R/host/opt/cni/bin" "$R/host/etc/cni/net.d" "$R/host/var/run/netns" "$R/opt/cni/bin" "$R$D"
ln -s /run "$R/var/run"
mount -t proc proc "$R/proc"
mount -t proc -o ro proc "$R/host/proc"
mkdir -p "$R/host$D/netns"
mount --rbind "$D/netns" "$R/host$D/netns"
mount --rbind "$D" "$R$D"
mount --bind "$D/bin" "$R/host/opt/cni/bin"
mount --bind "$D/net.d" "$R/host/etc/cni/net.d"
mount --bind "$D/ztunnel" "$R/run/ztunnel"
mount --bind "$D/sa" "$R/run/secrets/kubernetes.io/serviceaccount"
mount --bind "$D/image" "$R/opt/cni/bin"
# The node's kubelet, as istio-cni's nftables mode looks for it (by name, to
# match its probes by UID); it goes with the PID namespace.
mkdir -p "$D/kubelet" && ln -sf /bin/sleep "$D/kubelet/kubelet"
"$D/kubelet/kubelet" infinity &
cd /
exec chroot "$R" "$BIN" "$@"
`

// ready reports whether install-cni answers its readiness probe.
func (n *istioNode) ready() bool {
	resp, err := (&http.Client{Timeout: 2 * time.Second}).Get(n.readyURL)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// waitChained waits until install-cni is ready and has chained istio-cni
// last into the primary conflist, and returns that conflist.
func (n *istioNode) waitChained(ctx context.Context, within time.Duration) ([]byte, *libcni.NetworkConfigList, error) {
	deadline := time.Now().Add(within)
	for {
		if n.proc.Exited() {
			return nil, nil, fmt.Errorf("the Istio install-cni exited during start (%v); log tail:\n%s", n.proc.Err(), n.proc.LogTail(30))
		}
		if n.ready() {
			b, err := os.ReadFile(filepath.Join(n.ConfDir, "10-bridge.conflist"))
			if err == nil {
				if l, err := libcni.ConfListFromBytes(b); err == nil && len(l.Plugins) > 1 && l.Plugins[len(l.Plugins)-1].Network.Type == "istio-cni" {
					return b, l, nil
				}
			}
		}
		if time.Now().After(deadline) {
			return nil, nil, fmt.Errorf("the Istio install-cni not ready with istio-cni chained after %v; log tail:\n%s", within, n.proc.LogTail(30))
		}
		if err := sleep(ctx, 100*time.Millisecond); err != nil {
			return nil, nil, err
		}
	}
}

// Close stops install-cni, removes its bridge and the shared netns mount.
func (n *istioNode) Close() error {
	err := n.stop()
	if l, lerr := netlink.LinkByName(n.Bridge); lerr == nil {
		err = errors.Join(err, netlink.LinkDel(l))
	}
	if n.shared {
		if uerr := unix.Unmount(n.NetnsDir, unix.MNT_DETACH); uerr != nil && !errors.Is(uerr, unix.EINVAL) {
			err = errors.Join(err, fmt.Errorf("unmount %s: %w", n.NetnsDir, uerr))
		}
	}
	return err
}

// stop stops install-cni (SIGTERM, the chart's 5 s grace, as the kubelet
// does); the mount and PID namespaces go with it. A no-op when stopped.
func (n *istioNode) stop() error {
	var err error
	if n.proc != nil && !n.proc.Exited() {
		if n.agentPid != 0 {
			_ = unix.Kill(n.agentPid, unix.SIGTERM)
			for deadline := time.Now().Add(5 * time.Second); !n.proc.Exited() && time.Now().Before(deadline); {
				time.Sleep(20 * time.Millisecond)
			}
		}
		if !n.proc.Exited() {
			err = errors.Join(err, fmt.Errorf("the Istio install-cni did not stop within its grace: %w", n.proc.Stop(time.Second)))
		}
	}
	return err
}

// memTotal is the machine's memory in bytes (/proc/meminfo).
func memTotal() (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	m, err := procstat.ParseStatus(b, "MemTotal")
	if err != nil {
		return 0, err
	}
	return m["MemTotal"], nil
}
