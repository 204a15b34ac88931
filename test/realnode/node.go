// Package realnode runs a real Kubernetes node on this machine for the
// demo and the end-to-end tests: etcd, kube-apiserver,
// kube-controller-manager, kube-scheduler, containerd and kubelet (built by
// hack/kube-tools.sh), a bridge + host-local primary CNI network, and
// images built locally: the agent's image and the chart pushed to a
// registry on loopback (the CNCF distribution registry), the test images
// imported. ambient-cni is then installed the way a user installs it,
// with helm install oci://, and runs as a DaemonSet pod whose image
// containerd pulls by digest.
//
// Everything lives under one directory (/tmp/ambient-node-*), and Down
// leaves the host as Up found it: mounts, cgroups, links, iptables and
// nftables rules, ipsets and the files kubelet and containerd put at fixed
// host paths. A node whose owner died (a crash, a killed test) is torn
// down by the next Up, or by `go run ./test/realnode/cmd/node down`.
//
// The node is a host-wide thing (kubelet's kubepods cgroups, its iptables
// chains), so one runs at a time on a machine: Up waits for a lock.
package realnode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

const (
	// dirPrefix names node directories under the temporary directory;
	// Up finds stale nodes by it.
	dirPrefix = "ambient-node-"
	stateName = "node.json"
	// ReleaseNamespace is where the chart and the ztunnel stand-in go, as
	// Istio installs its node components.
	ReleaseNamespace = "istio-system"
)

// Options tune Up.
type Options struct {
	// Out receives progress lines (nil: discarded).
	Out io.Writer
	// Wait bounds each wait for a component (zero: 3 minutes, generous
	// for a busy 2-core machine).
	Wait time.Duration
	// StartupTaint registers the node with the CNI startup taint
	// (kubelet --register-with-taints), as a node pool set up for the
	// chart's startupTaint.enabled is.
	StartupTaint bool
	// Layout lays out the runtime's CNI dirs as a platform does, and
	// ChartValues names the platform (zero: generic).
	Layout Layout
	// Runc is the OCI runtime under containerd (empty: Tools.Runc, the
	// Debian package's), e.g. RecentRunc for user-namespaced pods.
	Runc string
	// Images reuses the images an earlier node of the process built (nil:
	// built into the node's directory).
	Images *ImageCache
}

// Node is a running node.
type Node struct {
	// Dir holds everything of the node; Name is its Node name.
	Dir, Name string
	// Kube is etcd + kube-apiserver with an admin client.
	Kube *kubeenv.Env
	// Client is the admin client; Kubeconfig its kubeconfig file.
	Client     kubernetes.Interface
	Kubeconfig string
	// APIPort is kube-apiserver's port on 127.0.0.1.
	APIPort int
	// ContainerdSocket is containerd's gRPC socket (CRI endpoint).
	ContainerdSocket string
	// CNIBinDir and CNIConfDir are the node's CNI directories; CNIConfFile
	// the primary conflist and CNIConfOriginal its content as written.
	CNIBinDir, CNIConfDir, CNIConfFile string
	CNIConfOriginal                    []byte
	// NetnsDir is where containerd mounts pod network namespaces.
	NetnsDir string
	// Bridge, Subnet and Gateway are the pod network.
	Bridge, Subnet, Gateway string
	// Images are the imported image names.
	Images Images
	// Tools are the binaries the node runs.
	Tools Tools

	opts        Options
	standInPort int
	guardBase   map[string]int
	st          *state
	lock        *os.File
	procs       []*childproc.Proc
	out         io.Writer
	// link and workers are the cluster's further nodes (AddWorker).
	link    *clusterLink
	workers []*Worker
}

// state is what Down needs, also from another process: node.json.
type state struct {
	Dir        string
	Owner      int
	OwnerStart uint64
	Name       string
	Bridge     string
	Subnet     string
	Guard      string
	// Cgroup is the node's cgroup v2 directory, OrigCgroup where the owner
	// was before joining it.
	Cgroup, OrigCgroup string
	Socket             string
	NetnsDir           string
	KubeletRoot        string
	Kubeconfig         string
	Crictl             string
	// Links are the cluster link and the workers' veths, WorkerCgroups
	// the workers' kubelet cgroup roots (AddWorker).
	Links         []string
	WorkerCgroups []string
	Before        before
}

// before is the host state Up found, so Down removes only what is new.
type before struct {
	Paths     map[string]bool
	Chains    map[string]map[string][]string // flavour → table → chains
	NftTables []string
	IPSets    []string
	Kubepods  []string
	Sysctls   map[string]string
	// ForwardPolicy is each iptables flavour's FORWARD policy (flanneld
	// sets ACCEPT).
	ForwardPolicy map[string]string
}

func (n *Node) logf(format string, args ...any) {
	if n.out != nil {
		fmt.Fprintf(n.out, format+"\n", args...)
	}
}

func (n *Node) saveState() error {
	b, err := json.MarshalIndent(n.st, "", "  ")
	if err != nil {
		return err
	}
	tmp := filepath.Join(n.Dir, stateName+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, filepath.Join(n.Dir, stateName))
}

// Up starts a node. On failure it tears down what it started and returns
// the error; ctx cancellation (Ctrl-C) counts as failure.
func Up(ctx context.Context, opts Options) (n *Node, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("a real node needs root (mounts, cgroups, network namespaces, iptables)")
	}
	if opts.Wait == 0 {
		opts.Wait = 3 * time.Minute
	}
	tools, err := FindTools()
	if err != nil {
		return nil, err
	}
	if opts.Runc != "" {
		tools.Runc = opts.Runc
	}
	n = &Node{opts: opts, out: opts.Out, Tools: tools}
	begin := time.Now()
	if n.lock, err = acquireLock(ctx, n.logf); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			if derr := n.Down(); derr != nil {
				err = errors.Join(err, fmt.Errorf("tear down after the failed start: %w", derr))
			}
		}
	}()
	reapStale(n.logf)

	if n.Dir, err = os.MkdirTemp("", dirPrefix); err != nil {
		return n, err
	}
	if err := os.Chmod(n.Dir, 0o755); err != nil {
		return n, err
	}
	n.Name = "ambient-" + strings.TrimPrefix(filepath.Base(n.Dir), dirPrefix)
	n.Name = strings.ToLower(n.Name)
	start, _ := procStart(os.Getpid())
	n.st = &state{Dir: n.Dir, Owner: os.Getpid(), OwnerStart: start, Name: n.Name}
	if n.st.Before, err = recordBefore(); err != nil {
		return n, err
	}
	if err := n.saveState(); err != nil {
		return n, err
	}
	n.logf("   node %s in %s", n.Name, n.Dir)

	if err := n.joinCgroup(); err != nil {
		return n, err
	}
	if err := n.network(); err != nil {
		return n, err
	}
	if err := n.saveState(); err != nil {
		return n, err
	}
	if err := n.startGuard(); err != nil {
		return n, err
	}

	n.logf("== control plane: etcd, kube-apiserver")
	n.Kube, err = kubeenv.Launch(ctx, kubeenv.Options{Dir: filepath.Join(n.Dir, "kube"), ReadyTimeout: opts.Wait, KubeletClient: true})
	if err != nil {
		return n, fmt.Errorf("start kube-apiserver: %w", err)
	}
	n.Client = n.Kube.Client
	u := strings.LastIndexByte(n.Kube.Config.Host, ':')
	n.APIPort, _ = strconv.Atoi(n.Kube.Config.Host[u+1:])
	n.Kubeconfig = filepath.Join(n.Dir, "kubeconfig")
	if err := kubeenv.WriteKubeconfig(n.Kube.Config, n.Kubeconfig); err != nil {
		return n, err
	}
	n.st.Kubeconfig = n.Kubeconfig
	if err := n.writeLayoutKubeconfig(); err != nil {
		return n, err
	}
	n.logf("   kube-apiserver ready on %s in %v", n.Kube.Config.Host, n.Kube.StartTime.Round(time.Millisecond))
	if err := n.startControllers(); err != nil {
		return n, err
	}

	n.logf("== container runtime: containerd")
	if err := n.startContainerd(ctx); err != nil {
		return n, err
	}
	if err := n.saveState(); err != nil {
		return n, err
	}
	n.logf("== images: the agent's and the chart pushed to a loopback registry, the test images imported")
	if n.Images, err = opts.Images.build(ctx, n.Dir, n.Tools, n.logf); err != nil {
		return n, err
	}
	if err := n.startRegistry(ctx); err != nil {
		return n, err
	}
	if n.Images.key, err = newReleaseKey(); err != nil {
		return n, err
	}
	if _, err := n.pushAgent(ctx, ImageTag); err != nil {
		return n, err
	}
	n.Images.Agent = n.AgentImage(ImageTag)
	if err := n.pushChart(ctx); err != nil {
		return n, err
	}
	if err := n.importImages(ctx); err != nil {
		return n, err
	}

	n.logf("== kubelet")
	if err := n.startKubelet(ctx); err != nil {
		return n, err
	}
	if err := n.saveState(); err != nil {
		return n, err
	}
	if err := n.extendGuard(); err != nil {
		return n, err
	}
	if _, err := n.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ReleaseNamespace}}, metav1.CreateOptions{}); err != nil {
		return n, fmt.Errorf("create namespace %s: %w", ReleaseNamespace, err)
	}
	n.logf("   node %s Ready; up in %v", n.Name, time.Since(begin).Round(time.Second))
	return n, nil
}

// recordBefore notes the host state that Down must not remove.
func recordBefore() (before, error) {
	b := before{Paths: existing(hostPaths), Chains: map[string]map[string][]string{}, ForwardPolicy: map[string]string{}}
	for _, f := range iptablesFlavours {
		save, err := iptablesSave(f)
		if err != nil {
			return b, err
		}
		b.Chains[f] = saveChains(save)
		b.ForwardPolicy[f] = forwardPolicy(save)
	}
	var err error
	if b.NftTables, err = nftTables(); err != nil {
		return b, err
	}
	if b.IPSets, err = ipsetNames(); err != nil {
		return b, err
	}
	b.Kubepods = kubeletCgroups()
	b.Sysctls = readSysctls()
	return b, nil
}

// joinCgroup moves this process into a cgroup v2 group of the node's own,
// so that everything the node starts (control plane, containerd, shims,
// containers, helm) is in it: the egress guard counts by it, and Down
// kills whatever is left in it.
func (n *Node) joinCgroup() error {
	root := cgroupV2Mount()
	if root == "" {
		return errors.New("no cgroup2 mount: the egress guard needs the unified hierarchy")
	}
	orig, err := ownCgroupV2()
	if err != nil {
		return err
	}
	dir := filepath.Join(root, filepath.Base(n.Dir))
	if err := os.Mkdir(dir, 0o755); err != nil {
		return fmt.Errorf("create cgroup %s: %w", dir, err)
	}
	n.st.Cgroup, n.st.OrigCgroup = dir, filepath.Join(root, orig)
	if err := n.saveState(); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return fmt.Errorf("join cgroup %s: %w", dir, err)
	}
	return nil
}

// ownCgroupV2 is this process's cgroup v2 path ("0::<path>").
func ownCgroupV2() (string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			return p, nil
		}
	}
	return "", errors.New("no cgroup v2 entry in /proc/self/cgroup")
}

// startControllers starts kube-controller-manager (DaemonSet, garbage
// collector, ServiceAccount and root CA publishing) and kube-scheduler.
func (n *Node) startControllers() error {
	kc := n.Kubeconfig
	common := []string{"--kubeconfig=" + kc, "--authentication-kubeconfig=" + kc, "--authorization-kubeconfig=" + kc, "--leader-elect=false", "--secure-port=0", "--v=1"}
	kcm := append([]string{
		// No cloud, no node IPAM (the bridge plugin's host-local does it),
		// and no node lifecycle (it would taint and evict on a slow node).
		"--controllers=*,-node-ipam-controller,-node-lifecycle-controller",
		"--service-account-private-key-file=" + n.Kube.ServiceAccountKeyFile,
		"--root-ca-file=" + n.Kube.CAFile,
		"--use-service-account-credentials=false",
	}, common...)
	p, err := childproc.Start("kube-controller-manager", n.Tools.ControllerManager, kcm, nil, filepath.Join(n.Dir, "kube-controller-manager.log"))
	if err != nil {
		return err
	}
	n.procs = append(n.procs, p)
	p, err = childproc.Start("kube-scheduler", n.Tools.Scheduler, common, nil, filepath.Join(n.Dir, "kube-scheduler.log"))
	if err != nil {
		return err
	}
	n.procs = append(n.procs, p)
	return nil
}

// proc returns the daemon named name, nil if not started.
func (n *Node) proc(name string) *childproc.Proc {
	for _, p := range n.procs {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// checkProcs fails when a daemon exited.
func (n *Node) checkProcs() error {
	for _, p := range n.procs {
		if p.Exited() {
			return fmt.Errorf("%s exited (%v); log tail:\n%s", p.Name, p.Err(), p.LogTail(25))
		}
	}
	return nil
}

// poll calls cond every interval until it returns true, an error, a
// daemon dies, or the timeout passes.
func (n *Node) poll(ctx context.Context, what string, timeout time.Duration, cond func(context.Context) (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for {
		ok, err := cond(ctx)
		if ok && err == nil {
			return nil
		}
		if err != nil {
			last = err
		}
		if perr := n.checkProcs(); perr != nil {
			return fmt.Errorf("%s: %w", what, perr)
		}
		select {
		case <-ctx.Done():
			if last != nil {
				return fmt.Errorf("%s: not done after %v (last error: %v)", what, timeout, last)
			}
			return fmt.Errorf("%s: not done after %v", what, timeout)
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// Down tears the node down and leaves the host as Up found it. It is safe
// to call more than once and on a half-started node. It fails when
// something could not be cleaned up, or when the egress guard saw a
// connection attempt off the machine during the node's life.
func (n *Node) Down() error {
	if n == nil || n.st == nil {
		if n != nil && n.lock != nil {
			releaseLock(n.lock)
			n.lock = nil
		}
		return nil
	}
	n.logf("== tearing the node down")
	begin := time.Now()
	phase := func(what string) { n.logf("   %s (%v)", what, time.Since(begin).Round(100*time.Millisecond)) }
	var errs []error
	// Further nodes first, each draining its own pods.
	for _, w := range slices.Clone(n.workers) {
		if err := w.Down(); err != nil {
			errs = append(errs, fmt.Errorf("node %s: %w", w.Name, err))
		}
	}
	// Pods first, through the API, while kubelet and the agent still run:
	// kubelet stops them and containerd runs CNI DEL for each.
	if n.Client != nil && n.proc("kubelet") != nil && !n.proc("kubelet").Exited() {
		if p := n.proc("kube-controller-manager"); p != nil {
			p.Stop(10 * time.Second) // no DaemonSet pod comes back
		}
		if err := n.deleteAllPods(); err != nil {
			n.logf("   %v (cleaning up below the API)", err)
		}
		phase("pods deleted")
	}
	for _, name := range []string{"kubelet", "kube-controller-manager", "kube-scheduler", "flanneld"} {
		n.proc(name).Stop(15 * time.Second)
	}
	guardErr := n.checkGuard()
	errs = append(errs, teardown(n.st, n.logf)...)
	n.proc("containerd").Stop(15 * time.Second)
	n.proc("registry").Stop(15 * time.Second)
	if n.Kube != nil {
		n.Kube.Stop()
	}
	phase("processes stopped")
	errs = append(errs, finish(n.st, n.logf)...)
	n.st = nil
	if n.lock != nil {
		releaseLock(n.lock)
		n.lock = nil
	}
	if len(errs) == 0 {
		n.logf("   torn down in %v; the host is as it was", time.Since(begin).Round(100*time.Millisecond))
	}
	return errors.Join(append([]error{guardErr}, errs...)...)
}

// deleteAllPods deletes the application pods first, while the agent still
// answers their CNI DEL, then the node components' pods, and waits each
// time until containerd has no ready sandbox of them left.
func (n *Node) deleteAllPods() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	zero := int64(0)
	nss, err := n.Client.CoreV1().Namespaces().List(ctx, metav1.ListOptions{})
	if err != nil {
		return err
	}
	for _, last := range []bool{false, true} {
		for _, ns := range nss.Items {
			if (ns.Name == ReleaseNamespace) == last {
				_ = n.Client.CoreV1().Pods(ns.Name).DeleteCollection(ctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{})
			}
		}
		for {
			left, err := n.sandboxNamespaces(ctx)
			if err == nil {
				if !last {
					left = slices.DeleteFunc(left, func(ns string) bool { return ns == ReleaseNamespace })
				}
				if len(left) == 0 {
					break
				}
			}
			select {
			case <-ctx.Done():
				return fmt.Errorf("pods still running after deleting them: in %v (%v)", left, err)
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	return nil
}

// sandboxNamespaces lists the namespace of every ready pod sandbox (a
// stopped one has its containers and network gone; kubelet's garbage
// collection removes it within a minute, teardown at once).
func (n *Node) sandboxNamespaces(ctx context.Context) ([]string, error) {
	out, err := n.crictl(ctx, "pods", "--state", "ready", "-o", "json")
	if err != nil {
		return nil, err
	}
	var l struct {
		Items []struct {
			Metadata struct{ Namespace string }
		}
	}
	if err := json.Unmarshal([]byte(out), &l); err != nil {
		return nil, err
	}
	var nss []string
	for _, it := range l.Items {
		nss = append(nss, it.Metadata.Namespace)
	}
	return nss, nil
}

// crictl runs crictl against the node's containerd.
func (n *Node) crictl(ctx context.Context, args ...string) (string, error) {
	return runCrictl(ctx, n.Tools.Crictl, n.ContainerdSocket, args...)
}

func runCrictl(ctx context.Context, bin, socket string, args ...string) (string, error) {
	return runCrictlVia(ctx, nil, bin, socket, args...)
}

// runCrictlVia is runCrictl under a command that runs it (nsenter into a
// worker's namespaces): its output alone, its warnings in the error.
func runCrictlVia(ctx context.Context, via []string, bin, socket string, args ...string) (string, error) {
	if bin == "" || socket == "" {
		return "", errors.New("no crictl or containerd socket")
	}
	ep := "unix://" + socket
	argv := slices.Concat(via, []string{bin, "--runtime-endpoint", ep, "--image-endpoint", ep, "--timeout", "30s"}, args)
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	out, err := cmd.Output()
	if err != nil {
		msg := ""
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			msg = strings.TrimSpace(string(ee.Stderr))
		}
		return string(out), fmt.Errorf("crictl %s: %w: %s", strings.Join(args, " "), err, msg)
	}
	return string(out), nil
}

// teardown removes pods below the API (CRI), while containerd runs.
func teardown(st *state, logf func(string, ...any)) []error {
	if st.Socket == "" {
		return nil
	}
	if _, err := os.Stat(st.Socket); err != nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, err := runCrictl(ctx, st.Crictl, st.Socket, "pods", "-q")
	if err != nil {
		logf("   %v", err)
		return nil
	}
	var errs []error
	for _, id := range strings.Fields(out) {
		if _, err := runCrictl(ctx, st.Crictl, st.Socket, "stopp", id); err != nil {
			errs = append(errs, err)
		}
		if _, err := runCrictl(ctx, st.Crictl, st.Socket, "rmp", "-f", id); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// finish removes everything the node left after its processes are
// stopped, in the order that lets each step succeed.
func finish(st *state, logf func(string, ...any)) []error {
	var errs []error
	// Shims outlive containerd by design, and containers their shims.
	if st.Socket != "" {
		for _, pid := range pidsWithArg(st.Socket) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if st.Cgroup != "" {
		if st.Owner == os.Getpid() && st.OrigCgroup != "" {
			if err := os.WriteFile(filepath.Join(st.OrigCgroup, "cgroup.procs"), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
				errs = append(errs, fmt.Errorf("leave cgroup %s: %w", st.Cgroup, err))
			}
		}
		if _, err := os.Stat(st.Cgroup); err == nil {
			if err := removeCgroupTree(st.Cgroup); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, c := range kubeletCgroups() {
		if slices.Contains(st.Before.Kubepods, c) {
			continue
		}
		if err := removeCgroupTree(c); err != nil {
			errs = append(errs, err)
		}
	}
	for _, c := range st.WorkerCgroups {
		if _, err := os.Stat(c); err == nil {
			if err := removeCgroupTree(c); err != nil {
				errs = append(errs, err)
			}
		}
	}
	unmount := []string{st.Dir}
	if !st.Before.Paths["/var/lib/kubelet"] {
		unmount = append(unmount, "/var/lib/kubelet")
	}
	if !st.Before.Paths["/run/containerd"] {
		unmount = append(unmount, "/run/containerd")
	}
	if err := unmountUnder(unmount...); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, removeLinks(st)...)
	for _, f := range iptablesFlavours {
		chains := append(slices.Clone(kubeletChains), iptables.ChainProbeSNAT)
		errs = append(errs, removeChains(f, append(chains, flannelChains...), st.Before.Chains[f])...)
	}
	if sets, err := ipsetNames(); err == nil {
		for _, s := range sets {
			if (s == ruleset.ProbeSetV4 || s == ruleset.ProbeSetV6) && !slices.Contains(st.Before.IPSets, s) {
				if out, err := exec.Command("ipset", "destroy", s).CombinedOutput(); err != nil {
					errs = append(errs, fmt.Errorf("ipset destroy %s: %v: %s", s, err, out))
				}
			}
		}
	}
	// The agent's host table (nftables backend), if it died with it.
	if !slices.Contains(st.Before.NftTables, "inet "+nftables.TableHost) {
		_ = exec.Command("nft", "delete", "table", "inet", nftables.TableHost).Run()
	}
	if st.Guard != "" {
		if err := removeGuard(st.Guard); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, removeEmptyNewTables(st.Before.NftTables)...)
	errs = append(errs, removeNew(st.Before.Paths)...)
	errs = append(errs, restoreSysctls(st.Before.Sysctls)...)
	errs = append(errs, restoreForwardPolicy(st.Before.ForwardPolicy)...)
	if len(errs) == 0 && st.Dir != "" {
		if err := os.RemoveAll(st.Dir); err != nil {
			errs = append(errs, err)
		}
	} else if st.Dir != "" {
		logf("   kept %s for a second look (run `go run ./test/realnode/cmd/node down -dir %s` to retry)", st.Dir, st.Dir)
	}
	return errs
}

// DownDir tears down a node from its directory: for a node whose owner
// died. It refuses while the owner still runs.
func DownDir(dir string, out io.Writer) error {
	b, err := os.ReadFile(filepath.Join(dir, stateName))
	if err != nil {
		return fmt.Errorf("not a node directory: %w", err)
	}
	var st state
	if err := json.Unmarshal(b, &st); err != nil {
		return fmt.Errorf("%s: %w", filepath.Join(dir, stateName), err)
	}
	if st.Owner != os.Getpid() && alive(st.Owner, st.OwnerStart) {
		return fmt.Errorf("node %s is still run by process %d: stop that process (Ctrl-C) to tear it down", dir, st.Owner)
	}
	logf := func(format string, args ...any) {
		if out != nil {
			fmt.Fprintf(out, format+"\n", args...)
		}
	}
	logf("== tearing down node %s (its owner is gone)", st.Dir)
	// Its daemons died with their owner (Pdeathsig), apart from
	// containerd's shims and their containers: stop containerd's pods if
	// it is alive, then the rest.
	errs := teardown(&st, logf)
	if st.Cgroup != "" {
		for _, pid := range cgroupPids(st.Cgroup) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	errs = append(errs, finish(&st, logf)...)
	return errors.Join(errs...)
}

// Reap tears down every node whose owner died, under the machine-wide
// lock (tests call it before recording the host's state).
func Reap(ctx context.Context, out io.Writer) error {
	logf := func(format string, args ...any) {
		if out != nil {
			fmt.Fprintf(out, format+"\n", args...)
		}
	}
	lock, err := acquireLock(ctx, logf)
	if err != nil {
		return err
	}
	defer releaseLock(lock)
	reapStale(logf)
	return nil
}

// reapStale tears down nodes whose owner died.
func reapStale(logf func(string, ...any)) {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), dirPrefix+"*"))
	for _, d := range dirs {
		if _, err := os.Stat(filepath.Join(d, stateName)); err != nil {
			continue
		}
		if err := DownDir(d, nil); err != nil {
			logf("   stale node %s: %v", d, err)
		} else {
			logf("   tore down stale node %s", d)
		}
	}
}

// AdminConfig loads the admin kubeconfig of a node directory.
func AdminConfig(dir string) (kubernetes.Interface, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", filepath.Join(dir, "kubeconfig"))
	if err != nil {
		return nil, err
	}
	return kubernetes.NewForConfig(cfg)
}

// randHex returns n random hex characters.
func randHex(n int) string { return strings.TrimPrefix(testnet.RandName("x", n), "x") }
