// Package cni runs the CNI plugin for real: the reference bridge and
// host-local plugins and ours, chained in a conflist like a real node's and
// driven through libcni, against an in-process node agent that applies the
// real in-pod rules in the rules backend the chart ships (auto:
// test/lib/simnode's Rules, as install-cni chooses).
//
// The node is not test/lib/simnode's whole node: the tests read and swap
// the agent itself (its state, its ZDS server, a stop between two CNI
// calls), which only an in-process agent allows, and the plugin's
// behaviour does not depend on how the agent learns about pods, so a fake
// pod cache (test/lib/fakecluster) stands in for the API server that a
// simnode needs. test/integration runs the plugin on the whole simulated
// node.
package cni

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/invoke"
	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/types/create"
	"github.com/containernetworking/cni/pkg/version"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/vishvananda/netlink"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/podcache"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/fakecluster"
	"github.com/ambient-cni/ambient-cni/test/lib/ourrules"
	"github.com/ambient-cni/ambient-cni/test/lib/simnode"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// recordingExec is libcni's own executor, remembering what each plugin
// printed so tests can compare our output with the bridge's.
type recordingExec struct {
	*invoke.DefaultExec
	mu  sync.Mutex
	out map[string][]byte // plugin type → last stdout
	// versions: plugin type → CNI version its results are converted to.
	versions map[string]string
}

func (r *recordingExec) ExecPlugin(ctx context.Context, path string, stdin []byte, env []string) ([]byte, error) {
	out, err := r.DefaultExec.ExecPlugin(ctx, path, stdin, env)
	r.mu.Lock()
	defer r.mu.Unlock()
	if v := r.versions[filepath.Base(path)]; v != "" && err == nil && len(out) > 0 {
		if out, err = resultAs(out, v); err != nil {
			return nil, err
		}
	}
	r.out[filepath.Base(path)] = out
	return out, err
}

// resultAs converts a plugin's result to CNI version v, as a plugin that
// answers in v whatever the config says would print it.
func resultAs(out []byte, v string) ([]byte, error) {
	res, err := create.CreateFromBytes(out)
	if err != nil {
		return nil, fmt.Errorf("parse result to convert: %w", err)
	}
	conv, err := res.GetAsVersion(v)
	if err != nil {
		return nil, fmt.Errorf("convert result to %s: %w", v, err)
	}
	var b bytes.Buffer
	if err := conv.PrintTo(&b); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// answerIn makes plugin print its results in CNI version v from now on.
func (r *recordingExec) answerIn(plugin, v string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.versions[plugin] = v
}

func (r *recordingExec) last(plugin string) []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.out[plugin]
}

// node is one simulated node: a bridge network, a CNI config, an agent.
type node struct {
	t       testing.TB
	version string
	dir     string
	layout  nodefiles.Layout
	bridge  string
	subnet  netip.Prefix
	gateway netip.Addr
	list    *libcni.NetworkConfigList
	cni     *libcni.CNIConfig
	rec     *recordingExec

	kube *fakecluster.Cluster
	// rules is the shipped backend's choice (rules.Name says which).
	rules *rulesbackend.Backend
	agent *nodeagent.Agent
	srv   *nodeagent.Server
	stop  func()
}

// TestMain runs the package in a network namespace of its own: its nodes'
// bridges and pod gateways live in the test process's namespace, where
// another package's or test run's bridge could hold the same random
// subnet. The reference CNI plugins are built first, outside, where their
// modules can be downloaded.
func TestMain(m *testing.M) {
	os.Exit(testnet.MainInOwnNetns(cnibin.Prefetch, m.Run))
}

func randByte() byte {
	var b [1]byte
	_, _ = rand.Read(b[:])
	return b[0]
}

// newNode sets up a node whose conflist has cniVersion cniVersion; extra
// keys go into our plugin's entry.
func newNode(t testing.TB, cniVersion string, extra map[string]any) *node {
	t.Helper()
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "ip")
	// A short private dir: the socket path must fit in sun_path.
	dir, err := os.MkdirTemp("", "acni-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	n := &node{
		t: t, version: cniVersion, dir: dir, layout: nodefiles.ForSocket(filepath.Join(dir, "run", "agent.sock")).WithStateDir(filepath.Join(dir, "state")),
		bridge: testnet.RandName("acb", 8),
	}
	n.subnet = netip.PrefixFrom(netip.AddrFrom4([4]byte{10, 100 + randByte()%50, randByte(), 0}), 24)
	n.gateway = n.subnet.Addr().Next()
	// The agent's state dir is private to the test (never the host's).
	keys := map[string]any{"agentSocket": n.layout.AgentSocket(), "stateDir": n.layout.StateDir(), "timeout": "20s", "logLevel": "debug"}
	for k, v := range extra {
		keys[k] = v
	}
	conf := cnibin.Conflist(cnibin.Network{
		CNIVersion: cniVersion, Bridge: n.bridge, Subnet: n.subnet,
		Subnet6: netip.MustParsePrefix(fmt.Sprintf("fd00:ac:%x::/64", uint16(randByte())<<8|uint16(randByte()))),
		DataDir: filepath.Join(dir, "ipam"), Plugin: keys,
	})
	n.list, err = libcni.ConfListFromBytes(conf)
	if err != nil {
		t.Fatalf("conflist: %v\n%s", err, conf)
	}
	n.rec = &recordingExec{DefaultExec: &invoke.DefaultExec{RawExec: &invoke.RawExec{Stderr: &testWriter{t: t}}, PluginDecoder: version.PluginDecoder{}},
		out: map[string][]byte{}, versions: map[string]string{}}
	n.cni = libcni.NewCNIConfigWithCacheDir(cnibin.Paths(t), filepath.Join(dir, "cache"), n.rec)
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(n.bridge); err == nil {
			_ = netlink.LinkDel(l)
		}
	})

	log := slog.New(slog.NewTextHandler(&testWriter{t: t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	n.kube = fakecluster.New(t, podcache.Config{Policy: enablement.DefaultPolicy()})
	n.rules = shippedRules(t, log)
	n.agent, err = nodeagent.NewAgent(nodeagent.Config{
		Rules: n.rules.Rules, Enablement: n.kube.Cache, Logger: log,
		Layout: n.layout,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = n.agent.Close() })
	n.kube.Cache.OnEnablementChange(func() { _ = n.agent.RefreshSnapshot() })
	n.kube.Start()
	n.kube.SetNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "shop",
		Labels: map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient}}})
	n.kube.SetNamespace(&corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "plain"}})
	// As install-cni does once its cache is synced.
	if err := n.agent.RefreshSnapshot(); err != nil {
		t.Fatal(err)
	}
	n.startAgent()
	return n
}

// startAgent starts the event server and replays the DEL spool, as the
// agent does at startup.
func (n *node) startAgent() {
	n.t.Helper()
	n.srv = nodeagent.NewServer(nodeagent.ServerConfig{Layout: n.layout, Logger: n.agentLog()}, n.kube.Cache, n.agent)
	if err := n.srv.Listen(); err != nil {
		n.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := n.srv.Serve(ctx); err != nil {
			n.t.Errorf("event server: %v", err)
		}
	}()
	var once sync.Once
	n.stop = func() { once.Do(func() { cancel(); <-done }) }
	n.t.Cleanup(n.stop)
	if _, err := n.agent.DrainSpool(ctx); err != nil {
		n.t.Fatal(err)
	}
}

func (n *node) agentLog() *slog.Logger {
	return slog.New(slog.NewTextHandler(&testWriter{t: n.t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// stopAgent stops the event server; the socket file goes with it.
func (n *node) stopAgent() { n.stop() }

// testWriter sends plugin stderr and agent logs to the test log.
type testWriter struct{ t testing.TB }

func (w *testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// sandbox is one pod sandbox on the node.
type sandbox struct {
	ns        ns.NetNS
	namespace string
	name      string
	uid       string
	id        string
}

// newPod creates a pod in the fake API server and its netns.
func (n *node) newPod(namespace, name string, labels map[string]string) *sandbox {
	n.t.Helper()
	id := make([]byte, 32)
	_, _ = rand.Read(id)
	s := &sandbox{ns: testnet.NewNS(n.t), namespace: namespace, name: name, uid: "uid-" + hex.EncodeToString(id[:8]), id: hex.EncodeToString(id)}
	n.kube.SetPod(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, UID: k8stypes.UID(s.uid), Labels: labels}})
	return s
}

func (s *sandbox) rt() *libcni.RuntimeConf {
	return &libcni.RuntimeConf{ContainerID: s.id, NetNS: s.ns.Path(), IfName: "eth0", Args: [][2]string{
		{"IgnoreUnknown", "1"}, {"K8S_POD_NAMESPACE", s.namespace}, {"K8S_POD_NAME", s.name},
		{"K8S_POD_INFRA_CONTAINER_ID", s.id}, {"K8S_POD_UID", s.uid},
	}}
}

func (n *node) add(s *sandbox) (types.Result, error) {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := n.cni.AddNetworkList(ctx, n.list, s.rt())
	n.t.Cleanup(func() { _ = n.cni.DelNetworkList(context.Background(), n.list, s.rt()) })
	return res, err
}

func (n *node) del(s *sandbox) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	return n.cni.DelNetworkList(ctx, n.list, s.rt())
}

func (n *node) check(s *sandbox) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	return n.cni.CheckNetworkList(ctx, n.list, s.rt())
}

// ourChains reports whether the sandbox's netns holds our rules in the
// agent's backend.
func (n *node) ourChains(t testing.TB, s *sandbox) bool {
	t.Helper()
	ipt, nft := ourrules.OurRules(t, s.ns.Path())
	if n.rules.Name == ourrules.NFTablesBackend {
		return nft
	}
	return ipt
}

// outputChain is how a drift report names the agent backend's outbound
// capture chain (DeleteFirstOutputRule's).
func (n *node) outputChain() string {
	if n.rules.Name == ourrules.NFTablesBackend {
		return nftables.TableNAT
	}
	return iptables.ChainOutput
}

// shippedRules builds the rules backend the chart ships, as install-cni
// chooses it, with the tools it needs.
func shippedRules(t testing.TB, log *slog.Logger) *rulesbackend.Backend {
	t.Helper()
	chart, err := simnode.CommittedChart()
	if err != nil {
		t.Fatal(err)
	}
	b, err := simnode.Rules(chart, "", log)
	if err != nil {
		testnet.Missing(t, "no usable rules backend: "+err.Error())
	}
	t.Cleanup(func() { _ = b.Close() })
	if b.Name == ourrules.NFTablesBackend {
		testnet.RequireCommands(t, "nft")
	} else {
		f := ourrules.IPTablesFlavour(t, b.Name)
		testnet.RequireCommands(t, f.SaveCmd(ruleset.IPv4), f.RestoreCmd(ruleset.IPv4), f.Cmd(ruleset.IPv4))
	}
	return b
}

// podAddr is the sandbox's IPv4 address on eth0.
func (s *sandbox) podAddr(t testing.TB) netip.Addr {
	t.Helper()
	var addr netip.Addr
	err := s.ns.Do(func(ns.NetNS) error {
		l, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		as, err := netlink.AddrList(l, netlink.FAMILY_V4)
		if err != nil || len(as) == 0 {
			return fmt.Errorf("no IPv4 address on eth0: %v", err)
		}
		addr, _ = netip.AddrFromSlice(as[0].IP.To4())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return addr
}
