package realnode

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// containerdConfig is containerd 2.x's config for the node (version 3,
// which every 2.x reads; the CRI plugin is split into
// io.containerd.cri.v1.images and io.containerd.cri.v1.runtime, and the
// CNI binaries are a list of directories). Everything it keeps lives under
// the node directory; the settings that matter on this kind of host are
// explained where they are set.
func (n *Node) containerdConfig() string {
	c := filepath.Join(n.Dir, "containerd")
	q := strconv.Quote
	return fmt.Sprintf(`version = 3
root = %s
state = %s
# Nothing from the host's /etc/containerd.
imports = []
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs", "io.containerd.differ.v1.erofs", "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp", "io.containerd.nri.v1.nri", "io.containerd.image-verifier.v1.bindir"]

[grpc]
  address = %s

[ttrpc]
  address = %s

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = %s

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"

  # One hosts.toml per registry host: the node's loopback registry
  # serves plain HTTP.
  [plugins."io.containerd.cri.v1.images".registry]
    config_path = %s

  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = %s

[plugins."io.containerd.cri.v1.runtime"]
  # Without CAP_SYS_RESOURCE every sandbox would fail to start.
  restrict_oom_score_adj = true
  # Pod netns files under the state dir (made a shared mount before
  # containerd starts), so the agent's HostToContainer mount sees them.
  netns_mounts_under_state_dir = true
  enable_selinux = false
  cdi_spec_dirs = []

  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"

    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        # kubelet uses the cgroupfs driver; containerd 2.x reports this
        # to kubelet through the RuntimeConfig CRI call.
        SystemdCgroup = false
        BinaryName = %s
        Root = %s

  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = [%s]
    conf_dir = %s
    max_conf_num = 1

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
`, q(filepath.Join(c, "root")), q(filepath.Join(c, "state")), q(n.ContainerdSocket), q(n.ContainerdSocket+".ttrpc"),
		q(filepath.Join(c, "opt")), q(n.registryHostsDir()), q(n.Images.Pause), q(n.Tools.Runc), q(filepath.Join(c, "runc")), q(n.CNIBinDir), q(n.CNIConfDir))
}

// startContainerd makes the netns dir a shared mount, writes the config,
// starts containerd and waits for its socket to answer.
func (n *Node) startContainerd(ctx context.Context) error {
	c := filepath.Join(n.Dir, "containerd")
	n.ContainerdSocket = filepath.Join(c, "containerd.sock")
	n.NetnsDir = filepath.Join(c, "state", "io.containerd.grpc.v1.cri", "netns")
	n.st.Socket, n.st.NetnsDir, n.st.Crictl = n.ContainerdSocket, n.NetnsDir, n.Tools.Crictl
	if err := n.saveState(); err != nil {
		return err
	}
	// A restarted containerd finds the bind still there: one more on top
	// would hide the netns files of running pods.
	if !isMountPoint(n.NetnsDir) {
		if err := makeSharedBind(n.NetnsDir); err != nil {
			return err
		}
	}
	// The pause image name is needed in the config before images exist.
	n.Images.Pause = imageName("pause")
	cfg := filepath.Join(c, "config.toml")
	if err := os.WriteFile(cfg, []byte(n.containerdConfig()), 0o600); err != nil {
		return err
	}
	// containerd finds its runc shim on PATH: the one built beside it.
	env := []string{"PATH=" + filepath.Dir(n.Tools.Containerd) + string(os.PathListSeparator) + os.Getenv("PATH")}
	p, err := childproc.Start("containerd", n.Tools.Containerd, []string{"--config", cfg, "--log-level", "info"}, env, filepath.Join(n.Dir, "containerd.log"))
	if err != nil {
		return err
	}
	n.procs = append(n.procs, p)
	return n.poll(ctx, "containerd", n.opts.Wait, func(ctx context.Context) (bool, error) {
		_, err := n.ctr(ctx, "version")
		return err == nil, err
	})
}

// ctr runs containerd's ctr in the CRI namespace.
func (n *Node) ctr(ctx context.Context, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, n.Tools.Ctr, append([]string{"--address", n.ContainerdSocket, "--namespace", "k8s.io"}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("ctr %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// importImages loads the image archives into containerd. The archives
// stay where they are: the node's directory goes with the node, an
// ImageCache's with its owner.
func (n *Node) importImages(ctx context.Context) error {
	for _, a := range n.Images.archives {
		start := time.Now()
		if _, err := n.ctr(ctx, "images", "import", a); err != nil {
			return err
		}
		n.logf("   imported %s in %v", filepath.Base(a), time.Since(start).Round(10*time.Millisecond))
	}
	return nil
}

// kubeletConfig is the KubeletConfiguration of the node; why each setting
// is needed on this kind of host is said next to it.
func (n *Node) kubeletConfig(port, healthzPort int) string {
	k := filepath.Join(n.Dir, "kubelet")
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This host has a cgroup v1 hybrid layout, which kubelet 1.37 refuses by default.
failCgroupV1: false
# Must match SystemdCgroup = false (kubelet also asks containerd 2.x through the
# RuntimeConfig CRI call).
cgroupDriver: cgroupfs
failSwapOn: false
address: 127.0.0.1
port: %d
healthzBindAddress: 127.0.0.1
healthzPort: %d
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: %q}
authorization: {mode: AlwaysAllow}
rotateCertificates: false
serverTLSBootstrap: false
containerRuntimeEndpoint: %q
podLogsDir: %q
volumePluginDir: %q
# Pods get no resolver: nothing on this node may look names up off the machine.
resolvConf: ""
# The test images exist only locally (imagePullPolicy: Never): never collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "50Mi", nodefs.available: "1%%", nodefs.inodesFree: "1%%", imagefs.available: "1%%"}
serializeImagePulls: false
shutdownGracePeriod: 0s
`, port, healthzPort, n.Kube.CAFile, "unix://"+n.ContainerdSocket, filepath.Join(n.Dir, "pod-logs"), filepath.Join(k, "volume-plugins"))
}

// startKubelet starts kubelet with a node identity and waits until the
// Node is Ready.
func (n *Node) startKubelet(ctx context.Context) error {
	k := filepath.Join(n.Dir, "kubelet")
	root := filepath.Join(k, "root")
	n.st.KubeletRoot = root
	if err := n.saveState(); err != nil {
		return err
	}
	for _, d := range []string{root, filepath.Join(k, "pki"), filepath.Join(n.Dir, "pod-logs")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	cfg, err := n.Kube.UserConfig("system:node:"+n.Name, "system:nodes")
	if err != nil {
		return err
	}
	kc := filepath.Join(k, "kubeconfig")
	if err := kubeenv.WriteKubeconfig(cfg, kc); err != nil {
		return err
	}
	ports, err := freePorts(2)
	if err != nil {
		return err
	}
	conf := filepath.Join(k, "config.yaml")
	if err := os.WriteFile(conf, []byte(n.kubeletConfig(ports[0], ports[1])), 0o600); err != nil {
		return err
	}
	args := []string{
		"--config=" + conf,
		"--kubeconfig=" + kc,
		"--root-dir=" + root,
		"--cert-dir=" + filepath.Join(k, "pki"),
		"--hostname-override=" + n.Name,
		// kubectl logs/exec reach the node by its InternalIP, 127.0.0.1,
		// where kubelet listens. kubelet refuses a loopback node IP and
		// then sets no address at all (nodeAddress sets it); without
		// this flag it would publish the machine's own address instead.
		"--node-ip=127.0.0.1",
		"--v=1",
	}
	if n.opts.StartupTaint {
		args = append(args, "--register-with-taints="+nodetaint.Key+"=:"+string(nodetaint.Effect))
	}
	p, err := childproc.Start("kubelet", n.Tools.Kubelet, args, nil, filepath.Join(n.Dir, "kubelet.log"))
	if err != nil {
		return err
	}
	n.procs = append(n.procs, p)
	if err := n.poll(ctx, "node Ready", n.opts.Wait, func(ctx context.Context) (bool, error) {
		node, err := n.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range node.Status.Conditions {
			if c.Type == corev1.NodeReady {
				if c.Status == corev1.ConditionTrue {
					return true, nil
				}
				return false, fmt.Errorf("node not ready: %s", c.Message)
			}
		}
		return false, nil
	}); err != nil {
		return err
	}
	return n.nodeAddress(ctx)
}

// nodeAddress gives the Node the addresses kubelet refuses to set itself
// (a loopback InternalIP): the API server reaches kubelet at the node's
// InternalIP for exec, attach and logs. kubelet's status updates leave an
// address list they failed to compute alone.
func (n *Node) nodeAddress(ctx context.Context) error {
	patch := fmt.Sprintf(`{"status":{"addresses":[{"type":"InternalIP","address":"127.0.0.1"},{"type":"Hostname","address":%q}]}}`, n.Name)
	if _, err := n.Client.CoreV1().Nodes().PatchStatus(ctx, n.Name, []byte(patch)); err != nil {
		return fmt.Errorf("set the node's addresses: %w", err)
	}
	return nil
}

// freePorts returns n distinct TCP ports, free on every address a moment
// ago, outside the kernel's ephemeral range
// (net.ipv4.ip_local_port_range). The services given them (the sink, the
// kubelet, the registry) listen again after each of the node's reboots,
// while containerd, restarted first, binds its streaming server to a port
// the kernel picks from that range: a port from the same range was taken
// from under a rebooted sink that way.
func freePorts(n int) ([]int, error) {
	lo, hi := 49152, 65535 // used when the range cannot be read or fills the port space
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			l, errL := strconv.Atoi(f[0])
			h, errH := strconv.Atoi(f[1])
			switch {
			case errL != nil || errH != nil:
			case l-1024 >= 4096:
				lo, hi = max(1024, l-16384), l-1
			case 65535-h >= 4096:
				lo, hi = h+1, 65535
			}
		}
	}
	var ports []int
	seen := map[int]bool{}
	for tries := 0; len(ports) < n; tries++ {
		if tries > 1000 {
			return nil, fmt.Errorf("no free TCP port in %d-%d after %d tries", lo, hi, tries)
		}
		p := lo + rand.IntN(hi-lo+1)
		if seen[p] {
			continue
		}
		seen[p] = true
		l, err := net.Listen("tcp", ":"+strconv.Itoa(p))
		if err != nil {
			continue
		}
		l.Close()
		ports = append(ports, p)
	}
	return ports, nil
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
