package simnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	installcni "github.com/ambient-cni/ambient-cni/cmd/install-cni/app"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// PrimaryConf is the node's primary CNI config the installer chains into.
const PrimaryConf = "10-bridge.conflist"

// Options shape one node. Env, Chart, Plugin, ReferencePlugins and Dir are
// required; InstallCNI too for StartAgent (a suite that runs the agent
// in-process, from Config and AgentConfig, has none).
type Options struct {
	// Env is the API server.
	Env *kubeenv.Env
	// Chart is what the DaemonSet runs (CommittedChart, RenderChart).
	Chart *Shipped
	// InstallCNI and Plugin are the shipped binaries (make build).
	InstallCNI, Plugin string
	// ReferencePlugins is the directory of the reference CNI plugins
	// (cnibin.Build); the node's CNI bin dir gets copies, as on a node.
	ReferencePlugins string
	// Dir holds the node (CNI dirs, sockets, logs). It must be short:
	// socket paths must fit in sun_path. The caller removes it.
	Dir string
	// Name is the node's name (default: random).
	Name string
	// Subnet is the pod network (default 10.64.0.0/16: a /16, as
	// host-local hands out addresses in order and a wrap within a run
	// would reuse a deleted pod's IP).
	Subnet netip.Prefix
	// Settings are install-cni settings (flag names) beyond the chart's
	// and NodeLocal; each caller says why it needs one.
	Settings map[string]string
	// APIHost, when set, is where the agent reaches Env's API server (a
	// proxy in front of it).
	APIHost string
	// RunOnTmpfs puts the agent's host directories (the chart's
	// /var/run/ambient-cni and /var/run/ztunnel) on a tmpfs, as /var/run
	// is on a node: its capture records are files there.
	RunOnTmpfs bool
	// Namespace is the agent's namespace, where its ServiceAccount is
	// bound to the shipped RBAC (default ReleaseNamespace, the chart's).
	// Another one also sets install-cni's pod-namespace, so that nodes
	// sharing an API server do not share a DaemonSet (whose presence
	// makes the agent's shutdown an upgrade).
	Namespace string
	// ExtraRBAC is RBAC YAML bound beside the shipped roles, for a chart
	// setting that adds rules (startupTaint.enabled adds nodes patch).
	ExtraRBAC []byte
	// Netns, when set, is a network namespace (a bind-mounted file) the
	// agent runs in, as a node of its own among many sharing one API
	// server: its host rules and metrics port are that namespace's. The
	// caller made it and reaches the API server from it (APIHost).
	Netns string
	// StandIn configures the ztunnel stand-ins (SocketPath is the node's;
	// a nil Logger discards).
	StandIn ztunnel.Config
}

// Node is one running simulated node. Its methods are safe for concurrent
// use.
type Node struct {
	// Name is the node's name; Dir, BinDir and ConfDir its directories;
	// Bridge its pod network's bridge; LogPath install-cni's log (every
	// agent started appends to it).
	Name, Dir, BinDir, ConfDir, Bridge, LogPath string
	// Config is how install-cni reads AgentEnv; AgentEnv is its whole
	// environment but PATH.
	Config   *installcni.Config
	AgentEnv map[string]string
	// MetricsURL is the agent's metrics server. Health has no TCP port by
	// default: Ready asks the root-only socket, as the chart's exec probe.
	MetricsURL string
	// Primary is the primary conflist as written; Chained is the conflist
	// after the installer chained the plugin into it.
	Primary, Chained []byte
	// AgentConfig is the agent's API client config: its ServiceAccount,
	// bound to the shipped RBAC.
	AgentConfig *rest.Config

	opts   Options
	runDir string

	mu     sync.Mutex
	agent  *childproc.Proc
	starts int
	// nodeKnown: the node's Node object exists; registered: StartAgent
	// created it (Close deletes it).
	nodeKnown, registered bool

	ztMu   sync.Mutex
	zt     *ztunnel.StandIn
	ztStop func() error
}

// Start builds the node, starts install-cni and the stand-in, and returns
// once the agent answers /readyz, the stand-in has its first snapshot and
// the installer has chained the plugin last into the primary conflist. On
// error, what it built is removed.
func Start(ctx context.Context, o Options) (n *Node, err error) {
	if n, err = Prepare(ctx, o); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, n.Close())
			n = nil
		}
	}()
	if _, err := n.StartAgent(); err != nil {
		return nil, err
	}
	if err := n.WaitReady(ctx, 2*time.Minute); err != nil {
		return nil, err
	}
	z := n.StartStandIn(ztunnel.Faults{})
	wctx, cancel := context.WithTimeout(ctx, time.Minute)
	err = z.Wait(wctx, z.Ready)
	cancel()
	if err != nil {
		return nil, fmt.Errorf("the ztunnel stand-in got no snapshot: %w", err)
	}
	if n.Chained, err = os.ReadFile(filepath.Join(n.ConfDir, PrimaryConf)); err != nil {
		return nil, err
	}
	chained, err := libcni.ConfListFromBytes(n.Chained)
	if err != nil {
		return nil, err
	}
	if len(chained.Plugins) < 2 || chained.Plugins[len(chained.Plugins)-1].Network.Type != n.Config.PluginType {
		return nil, fmt.Errorf("the agent is ready but did not chain %s last into %s:\n%s", n.Config.PluginType, PrimaryConf, n.Chained)
	}
	return n, nil
}

// Prepare builds the node (directories, CNI bin dir, primary conflist, the
// agent's kubeconfig under the shipped RBAC, its environment) without
// starting anything.
func Prepare(ctx context.Context, o Options) (n *Node, err error) {
	if o.Env == nil || o.Chart == nil || o.Plugin == "" || o.ReferencePlugins == "" || o.Dir == "" {
		return nil, errors.New("simnode: Env, Chart, Plugin, ReferencePlugins and Dir are required")
	}
	if o.Namespace == "" {
		o.Namespace = ReleaseNamespace
	}
	settings := maps.Clone(o.Settings)
	if o.Namespace != ReleaseNamespace {
		if settings == nil {
			settings = map[string]string{}
		}
		settings["pod-namespace"] = o.Namespace
	}
	if o.Name == "" {
		o.Name = testnet.RandName("node-", 6)
	}
	if !o.Subnet.IsValid() {
		o.Subnet = netip.MustParsePrefix("10.64.0.0/16")
	}
	n = &Node{
		Name: o.Name, Dir: o.Dir, BinDir: filepath.Join(o.Dir, "bin"), ConfDir: filepath.Join(o.Dir, "net.d"),
		Bridge: testnet.RandName("sn", 8), LogPath: filepath.Join(o.Dir, "install-cni.log"),
		opts: o, runDir: filepath.Join(o.Dir, "run"),
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, n.Close())
			n = nil
		}
	}()
	for _, d := range []string{n.BinDir, n.ConfDir, n.runDir} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return n, err
		}
	}
	if o.RunOnTmpfs {
		if err := unix.Mount("tmpfs", n.runDir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "size=64m,mode=0755"); err != nil {
			return n, fmt.Errorf("mount a tmpfs at %s: %w", n.runDir, err)
		}
	}
	for _, p := range cnibin.ReferencePlugins {
		b, err := os.ReadFile(filepath.Join(o.ReferencePlugins, p))
		if err != nil {
			return n, err
		}
		if err := os.WriteFile(filepath.Join(n.BinDir, p), b, 0o755); err != nil {
			return n, err
		}
	}
	n.Primary = cnibin.Conflist(cnibin.Network{Bridge: n.Bridge, Subnet: o.Subnet, DataDir: filepath.Join(o.Dir, "ipam")})
	if err := os.WriteFile(filepath.Join(n.ConfDir, PrimaryConf), n.Primary, 0o644); err != nil {
		return n, err
	}
	roles, err := kubeenv.ExtractRoles(o.Chart.Manifest)
	if err != nil {
		return n, err
	}
	roles = append(roles, o.ExtraRBAC...)
	saCfg, err := o.Env.ServiceAccountConfig(ctx, o.Namespace, o.Chart.ServiceAccount, roles)
	if err != nil {
		return n, err
	}
	if o.APIHost != "" {
		saCfg = rest.CopyConfig(saCfg)
		saCfg.Host = o.APIHost
	}
	n.AgentConfig = saCfg
	kubeconfig := filepath.Join(o.Dir, "agent.kubeconfig")
	if err := kubeenv.WriteKubeconfig(saCfg, kubeconfig); err != nil {
		return n, err
	}
	if n.AgentEnv, err = AgentEnv(o.Chart, Paths{
		Name: n.Name, PodName: "ambient-cni-" + n.Name,
		CNIBinDir: n.BinDir, CNIConfDir: n.ConfDir, PluginBinary: o.Plugin,
		AgentSocket: filepath.Join(n.runDir, "ambient-cni", "agent.sock"),
		ZDSSocket:   filepath.Join(n.runDir, "ztunnel", "ztunnel.sock"),
		// On the node's disk, beside the tmpfs run directory, as
		// /var/lib is beside /var/run.
		StateDir:   filepath.Join(o.Dir, "state"),
		Kubeconfig: kubeconfig,
	}, settings); err != nil {
		return n, err
	}
	if n.Config, err = installcni.Parse(nil, func(k string) string { return n.AgentEnv[k] }, io.Discard); err != nil {
		return n, fmt.Errorf("install-cni refuses the node's environment: %w", err)
	}
	if sa := n.Config.PluginServiceAccount; sa != "" {
		// The chart's ServiceAccount for the plugin, with its roles: the
		// agent writes the plugin a credential of it, which the plugin uses
		// while the agent cannot answer, as on a node the chart installed.
		pluginRoles, err := kubeenv.ExtractPluginRoles(o.Chart.Manifest)
		if err != nil {
			return n, fmt.Errorf("the plugin's roles: %w", err)
		}
		if _, err := o.Env.ServiceAccountConfig(ctx, o.Namespace, sa, pluginRoles); err != nil {
			return n, fmt.Errorf("the plugin's ServiceAccount %s: %w", sa, err)
		}
	}
	n.MetricsURL = HealthURL(n.Config.MetricsAddr)
	return n, nil
}

// StartAgent starts a new install-cni process with the chart's arguments
// and the node's environment, its output appended to LogPath after a line
// that counts the starts. One must not be running.
func (n *Node) StartAgent() (*childproc.Proc, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.agent != nil && !n.agent.Exited() {
		return nil, errors.New("an agent is already running")
	}
	if n.opts.InstallCNI == "" {
		return nil, errors.New("simnode: no InstallCNI binary to start")
	}
	if !n.nodeKnown {
		// kubelet registers its Node before it runs the node's pods: the
		// agent's credential for the plugin is a token bound to it, and
		// the plugin asks the API server with it while the agent is away.
		created, err := n.register(context.Background())
		if err != nil {
			return nil, err
		}
		n.nodeKnown, n.registered = true, created
	}
	n.starts++
	if f, err := os.OpenFile(n.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600); err == nil {
		fmt.Fprintf(f, "{\"msg\":\"simnode: starting install-cni #%d\"}\n", n.starts)
		_ = f.Close()
	}
	argv := append([]string{n.opts.InstallCNI}, n.opts.Chart.Args...)
	if n.opts.Netns != "" {
		// nsenter execs install-cni: the process started is the agent.
		argv = append([]string{"nsenter", "--net=" + n.opts.Netns, "--"}, argv...)
	}
	p, err := childproc.StartEnviron("install-cni", argv[0], argv[1:], Environ(n.AgentEnv), n.LogPath)
	if err != nil {
		return nil, err
	}
	n.agent = p
	return p, nil
}

// Agent is the latest install-cni process (nil before the first start
// and after StopAgent).
func (n *Node) Agent() *childproc.Proc {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.agent
}

// AgentStarts is how many install-cni processes were started.
func (n *Node) AgentStarts() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.starts
}

// KillAgent SIGKILLs the running agent, as an OOM kill would: nothing of
// its shutdown runs.
func (n *Node) KillAgent() {
	n.Agent().Kill()
}

// StopAgent stops the agent as the kubelet would (SIGTERM, 30 s grace);
// with no DaemonSet in the API this is an uninstall. It returns how a
// running agent ended; an exited one is forgotten silently (its end was
// seen where it happened).
func (n *Node) StopAgent() error {
	n.mu.Lock()
	p := n.agent
	n.agent = nil
	n.mu.Unlock()
	if p == nil || p.Exited() {
		return nil
	}
	if err := p.Stop(30 * time.Second); err != nil {
		return fmt.Errorf("install-cni shutdown: %w; log tail:\n%s", err, p.LogTail(20))
	}
	return nil
}

// Ready reports whether the agent answers /readyz with 200, asked as the
// chart's exec probe asks it: over the root-only debug socket.
func (n *Node) Ready() bool {
	code, err := installcni.AskAgent(context.Background(), n.Config.Layout(), "/readyz", 2*time.Second, io.Discard)
	return err == nil && code == http.StatusOK
}

// WaitReady waits for /readyz; the agent exiting meanwhile is an error.
func (n *Node) WaitReady(ctx context.Context, within time.Duration) error {
	deadline := time.Now().Add(within)
	for !n.Ready() {
		p := n.Agent()
		if p == nil || p.Exited() {
			var exit error
			if p != nil {
				exit = p.Err()
			}
			return fmt.Errorf("install-cni exited during start (%v); log tail:\n%s", exit, LogTail(n.LogPath, 30))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("install-cni not ready after %v; log tail:\n%s", within, LogTail(n.LogPath, 30))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	return nil
}

// StartStandIn starts a fresh ztunnel stand-in (no workloads, as a
// restarted ztunnel) on the node's ZDS socket, replacing a stopped one,
// misbehaving with faults from the start.
func (n *Node) StartStandIn(faults ztunnel.Faults) *ztunnel.StandIn {
	n.ztMu.Lock()
	defer n.ztMu.Unlock()
	cfg := n.opts.StandIn
	cfg.SocketPath = n.Config.ZDSSocket
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	z := ztunnel.New(cfg)
	z.SetFaults(faults)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- z.Run(ctx) }() // owner: the Node; StopStandIn waits
	var once sync.Once
	var runErr error
	n.zt = z
	n.ztStop = func() error {
		once.Do(func() { cancel(); runErr = <-done })
		return runErr
	}
	return z
}

// StandIn is the current stand-in.
func (n *Node) StandIn() *ztunnel.StandIn {
	n.ztMu.Lock()
	defer n.ztMu.Unlock()
	return n.zt
}

// StopStandIn stops the stand-in as a killed ztunnel goes: its connection
// closes and every pod it served is dropped with it.
func (n *Node) StopStandIn() error {
	n.ztMu.Lock()
	stop := n.ztStop
	n.ztStop = nil
	n.ztMu.Unlock()
	if stop == nil {
		return nil
	}
	if err := stop(); err != nil {
		return fmt.Errorf("ztunnel stand-in: %w", err)
	}
	return nil
}

// Kubelet is a kubelet simulator for the node over the chained conflist;
// the plugins' own logs (the shipped plugin warns on every call while the
// agent is down) go to Dir/plugins.log, not the caller's output.
func (n *Node) Kubelet(owner kubesim.T) (*kubesim.Node, error) {
	pluginLog, err := os.OpenFile(filepath.Join(n.Dir, "plugins.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	owner.Cleanup(func() { _ = pluginLog.Close() })
	k := kubesim.NewNode(owner, n.opts.Env.Client, n.Name, []string{n.BinDir}, n.Chained)
	k.CNI = n.CNI(pluginLog)
	return k, nil
}

// CNI is a CNI runtime over the node's bin dir, the plugins' stderr to
// pluginLog.
func (n *Node) CNI(pluginLog io.Writer) *libcni.CNIConfig {
	return libcni.NewCNIConfigWithCacheDir([]string{n.BinDir}, filepath.Join(n.Dir, "cni-cache"),
		&invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: pluginLog}, PluginDecoder: version.PluginDecoder{}})
}

// Close stops the stand-in and the agent (SIGTERM: an uninstall), removes
// the bridge and unmounts the tmpfs. Dir is the caller's to remove.
func (n *Node) Close() error {
	err := errors.Join(n.StopStandIn(), n.StopAgent())
	n.mu.Lock()
	registered := n.registered
	n.mu.Unlock()
	if registered {
		if derr := n.opts.Env.Client.CoreV1().Nodes().Delete(context.Background(), n.Name, metav1.DeleteOptions{}); derr != nil && !apierrors.IsNotFound(derr) {
			err = errors.Join(err, fmt.Errorf("delete node %s: %w", n.Name, derr))
		}
	}
	if l, lerr := netlink.LinkByName(n.Bridge); lerr == nil {
		err = errors.Join(err, netlink.LinkDel(l))
	}
	if n.opts.RunOnTmpfs {
		if uerr := unix.Unmount(n.runDir, unix.MNT_DETACH); uerr != nil && !errors.Is(uerr, unix.EINVAL) {
			err = errors.Join(err, fmt.Errorf("unmount %s: %w", n.runDir, uerr))
		}
	}
	return err
}

// HealthURL turns one of the agent's listen addresses (e.g. the metrics
// address ":9974") into a URL on loopback.
func HealthURL(addr string) string {
	host, port, ok := strings.Cut(addr, ":")
	if !ok {
		return "http://" + addr
	}
	if host == "" || host == "0.0.0.0" || host == "[::]" {
		host = "127.0.0.1"
	}
	return "http://" + host + ":" + port
}

// LogTail is the last lines of the log at path, for error messages.
func LogTail(path string, lines int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	all := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}

// register creates the node's Node object as kubelet does, unless the
// test made one already (then Close leaves it alone, as that test owns it).
// It reports whether it created it.
func (n *Node) register(ctx context.Context) (bool, error) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name, Labels: map[string]string{"kubernetes.io/hostname": n.Name}}}
	_, err := n.opts.Env.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("register node %s: %w", n.Name, err)
	}
	return true, nil
}
