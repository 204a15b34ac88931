package cni

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
	current "github.com/containernetworking/cni/pkg/types/100"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/zds"
	"github.com/ambient-cni/ambient-cni/test/lib/captureproxy"
	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/ourrules"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// Versions is the CNI spec version matrix the plugin supports.
var Versions = []string{"0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"}

func sameJSON(t *testing.T, a, b []byte) bool {
	t.Helper()
	var x, y any
	if err := json.Unmarshal(a, &x); err != nil {
		t.Fatalf("decode %s: %v", a, err)
	}
	if err := json.Unmarshal(b, &y); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return string(xa) == string(ya)
}

// hostProxy listens in the host netns on a free port of the bridge's
// gateway address, standing in for "some destination outside the pod".
func hostProxy(t *testing.T, gw netip.Addr) (*captureproxy.Proxy, netip.AddrPort) {
	t.Helper()
	p, err := captureproxy.Start("", captureproxy.Config{TCPPorts: []uint16{0}, NoIPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p, netip.AddrPortFrom(gw, p.Addrs()[0].Port())
}

func TestChainVersionMatrix(t *testing.T) {
	for _, v := range Versions {
		t.Run(v, func(t *testing.T) { chainScenario(t, v) })
	}
}

// chainScenario: ADD/CHECK/DEL of an enabled and a disabled pod through
// bridge + host-local + ambient-cni at cniVersion v.
func chainScenario(t *testing.T, v string) {
	n := newNode(t, v, nil)
	ctx := context.Background()
	_, dst := hostProxy(t, n.gateway)

	// Enabled pod: rules in place when ADD returns, result = bridge's.
	web := n.newPod("shop", "web", nil)
	res, err := n.add(web)
	if err != nil {
		t.Fatalf("ADD enabled pod: %v", err)
	}
	if res.Version() != v {
		t.Errorf("result version %s, want %s", res.Version(), v)
	}
	ours, bridge := n.rec.last("ambient-cni"), n.rec.last("bridge")
	if len(ours) == 0 || len(bridge) == 0 || !sameJSON(t, ours, bridge) {
		t.Errorf("our result differs from the bridge's:\nours:   %s\nbridge: %s", ours, bridge)
	}
	var shape struct {
		CNIVersion string `json:"cniVersion"`
		IPs        []struct {
			Version *string `json:"version"`
		} `json:"ips"`
	}
	if err := json.Unmarshal(ours, &shape); err != nil || shape.CNIVersion != v || len(shape.IPs) != 2 {
		t.Fatalf("result %s (%v)", ours, err)
	}
	if hasVer := shape.IPs[0].Version != nil; hasVer != strings.HasPrefix(v, "0.") {
		t.Errorf("result not in %s format: %s", v, ours)
	}
	cur, err := current.NewResultFromResult(res)
	if err != nil {
		t.Fatal(err)
	}
	podIP := web.podAddr(t)
	if got, _ := netip.AddrFromSlice(cur.IPs[0].Address.IP.To4()); got != podIP {
		t.Errorf("result IP %s, pod has %s", got, podIP)
	}
	p := n.agent.Pods()
	if len(p) != 1 {
		t.Fatalf("agent state %+v", p)
	}
	type state struct {
		Name, SandboxID string
		IPs             int
	}
	if diff := cmp.Diff(state{"web", web.id, 2}, state{p[0].Name, p[0].SandboxID, len(p[0].IPs)}); diff != "" {
		t.Fatalf("agent state (-want +got):\n%s", diff)
	}

	// The rules work: outbound lands on 15001, inbound on 15006.
	proxy, err := captureproxy.Start(web.ns.Path(), captureproxy.Config{TCPPorts: []uint16{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort}})
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	rec, err := captureproxy.Dial(ctx, web.ns.Path(), dst, captureproxy.DialOptions{})
	if err != nil || rec.Port != ambient.ZtunnelOutboundPort || rec.OrigDst != dst {
		t.Errorf("outbound from enabled pod: %v, %v; want port 15001 with original destination %s", rec, err, dst)
	}
	in := netip.AddrPortFrom(podIP, 8080)
	rec, err = captureproxy.Dial(ctx, "", in, captureproxy.DialOptions{})
	if err != nil || rec.Port != ambient.ZtunnelInboundPlaintextPort || rec.OrigDst != in {
		t.Errorf("inbound to enabled pod: %v, %v; want port 15006 with original destination %s", rec, err, in)
	}

	// Disabled pod: passes through, no rules, traffic goes straight out.
	plain := n.newPod("plain", "db", nil)
	if _, err := n.add(plain); err != nil {
		t.Fatalf("ADD disabled pod: %v", err)
	}
	if !sameJSON(t, n.rec.last("ambient-cni"), n.rec.last("bridge")) {
		t.Errorf("disabled pod: our result differs from the bridge's")
	}
	if n.ourChains(t, plain) {
		t.Errorf("disabled pod got our chains")
	}
	plainProxy, err := captureproxy.Start(plain.ns.Path(), captureproxy.Config{TCPPorts: []uint16{ambient.ZtunnelOutboundPort}})
	if err != nil {
		t.Fatal(err)
	}
	defer plainProxy.Close()
	if rec, err := captureproxy.Dial(ctx, plain.ns.Path(), dst, captureproxy.DialOptions{}); err != nil || rec.Port != dst.Port() {
		t.Errorf("outbound from disabled pod: %v, %v; want the host listener directly", rec, err)
	}
	if len(n.agent.Pods()) != 1 {
		t.Errorf("disabled pod entered the agent state: %+v", n.agent.Pods())
	}

	// CHECK (0.4.0+): clean, then fails once a rule is deleted by hand.
	if v != "0.3.0" && v != "0.3.1" {
		if err := n.check(web); err != nil {
			t.Errorf("CHECK of intact pod: %v", err)
		}
		if err := n.check(plain); err != nil {
			t.Errorf("CHECK of disabled pod: %v", err)
		}
		ourrules.DeleteFirstOutputRule(t, n.rules.Name, web.ns.Path())
		err := n.check(web)
		if err == nil || !strings.Contains(err.Error(), "drifted") || !strings.Contains(err.Error(), n.outputChain()) {
			t.Errorf("CHECK after deleting a rule by hand: %v", err)
		}
	}

	// DEL twice succeeds; the state is gone. The rules are left to go
	// with the namespace, which the runtime destroys after DEL: the DEL
	// fast path does not rewrite them.
	for i := range 2 {
		if err := n.del(web); err != nil {
			t.Fatalf("DEL #%d: %v", i+1, err)
		}
	}
	if len(n.agent.Pods()) != 0 {
		t.Errorf("agent state after DEL: %+v", n.agent.Pods())
	}
	if !n.ourChains(t, web) {
		t.Errorf("DEL rewrote the rules of a namespace about to be destroyed")
	}
	if err := n.del(plain); err != nil {
		t.Errorf("DEL disabled pod: %v", err)
	}
}

func cniCode(err error) uint {
	var te *types.Error
	if errors.As(err, &te) {
		return te.Code
	}
	return 0
}

// TestChainAgentDown: with the agent stopped and no API server to ask (no
// fallback binary), through the real chain, the shipped default fails a
// new pod with code 11 in an enabled namespace and in one the agent's
// persistent snapshot saw not enabled (the new pod's labels are unknown);
// excluded namespaces start, DEL is spooled, and pods start again once the
// agent is back.
func TestChainAgentDown(t *testing.T) {
	n := newNode(t, "1.0.0", nil)
	// Enroll a pod while the agent is up; the snapshot now names "shop".
	web := n.newPod("shop", "web", nil)
	if _, err := n.add(web); err != nil {
		t.Fatal(err)
	}
	if !n.ourChains(t, web) {
		t.Fatal("no rules after ADD")
	}
	snap, err := nodefiles.ReadSnapshot(n.layout.StateSnapshot())
	if err != nil || strings.Join(snap.EnabledNamespaces, ",") != "shop" || !slices.Contains(snap.Namespaces, "plain") {
		t.Fatalf("snapshot %+v, %v", snap, err)
	}
	n.stopAgent()
	if _, err := os.Stat(n.layout.AgentSocket()); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("socket still present after stop: %v", err)
	}

	// No API server to ask (no fallback binary here): the enabled
	// namespace, and a new pod of one the snapshot saw as not enabled
	// (its labels unknown), both fail closed, retryable, saying why.
	for _, ns := range []string{"shop", "plain"} {
		p := n.newPod(ns, "api", nil)
		_, err = n.add(p)
		if cniCode(err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), "unreachable") ||
			!strings.Contains(err.Error(), "the API server cannot be asked") {
			t.Errorf("ADD in namespace %s with agent down: %v; want code 11", ns, err)
		}
		if n.ourChains(t, p) {
			t.Errorf("failed ADD in %s left rules", ns)
		}
		_ = n.del(p)
	}
	// Excluded namespace (the plugin's own config): starts at once.
	sys := n.newPod("kube-system", "dns", nil)
	if _, err := n.add(sys); err != nil {
		t.Errorf("ADD in an excluded namespace with agent down: %v", err)
	}
	// DEL succeeds and is spooled.
	if err := n.del(web); err != nil {
		t.Fatalf("DEL with agent down: %v", err)
	}
	entries, err := nodefiles.List(n.layout.DelSpool())
	if err != nil || len(entries) == 0 {
		t.Fatalf("spool %+v, %v", entries, err)
	}
	if len(n.agent.Pods()) != 1 {
		t.Fatalf("agent state changed while it was down")
	}
	// The agent returns: the pod is cleaned up.
	n.startAgent()
	if len(n.agent.Pods()) != 0 {
		t.Errorf("pod not cleaned up after the agent returned: %+v", n.agent.Pods())
	}
	if entries, _ := nodefiles.List(n.layout.DelSpool()); len(entries) != 0 {
		t.Errorf("spool not drained: %+v", entries)
	}
	// And the runtime's retries succeed.
	for _, ns := range []string{"shop", "plain"} {
		if _, err := n.add(n.newPod(ns, "api2", nil)); err != nil {
			t.Errorf("ADD in %s after the agent returned: %v", ns, err)
		}
	}
}

// fakeFallback stands in for the fallback binary with the API server up:
// namespace shop is labelled ambient, and so is any pod named "late" (its
// own label, put on while the agent was gone).
const fakeFallback = `#!/bin/sh
req=$(cat)
case "$req" in
*'"namespace":"shop"'*) echo '{"enroll":true,"reason":"namespace labelled ambient"}';;
*'"name":"late"'*) echo '{"enroll":true,"reason":"pod labelled ambient"}';;
*) echo '{"enroll":false,"reason":"neither pod nor namespace labelled ambient"}';;
esac
`

// TestChainAgentDownFallback: with the agent gone the plugin asks the API
// server (through the fallback binary in the state dir): a pod of an
// enabled namespace and a pod opted in by its own label while the agent
// was gone both wait, a plain pod starts at once, recorded; with
// agentUnreachable "fail-closed" every pod waits. When the agent returns
// the waiting pods are captured on the runtime's retry and the recorded
// one is re-checked and left alone.
func TestChainAgentDownFallback(t *testing.T) {
	n := newNode(t, "1.0.0", nil)
	if _, err := n.add(n.newPod("shop", "web", nil)); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(n.layout.FallbackBinary(), []byte(fakeFallback), 0o700); err != nil {
		t.Fatal(err)
	}
	n.stopAgent()
	late := n.newPod("plain", "late", map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeAmbient})
	api := n.newPod("shop", "api", nil)
	if _, err := n.add(api); cniCode(err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), "must be captured") {
		t.Errorf("ADD in enabled namespace with agent gone: %v", err)
	}
	if _, err := n.add(late); cniCode(err) != types.ErrTryAgainLater {
		t.Errorf("SECURITY: ADD of a pod opted in by its label in a plain namespace, agent gone: %v; want code 11", err)
	}
	plain := n.newPod("plain", "db", nil)
	if _, err := n.add(plain); err != nil {
		t.Errorf("ADD in plain namespace with agent gone: %v", err)
	}
	if n.ourChains(t, plain) || n.ourChains(t, late) {
		t.Errorf("pass-through or failed pod got rules")
	}
	if e, err := nodefiles.ListAdds(n.layout.AddSpool()); err != nil || len(e) != 1 {
		t.Errorf("ADD spool %+v, %v; want the passed-through pod", e, err)
	}

	strict := newNode(t, "1.0.0", map[string]any{"agentUnreachable": ambient.AgentUnreachableFailClosed})
	if err := os.WriteFile(strict.layout.FallbackBinary(), []byte(fakeFallback), 0o700); err != nil {
		t.Fatal(err)
	}
	strict.stopAgent()
	if _, err := strict.add(strict.newPod("plain", "db", nil)); cniCode(err) != types.ErrTryAgainLater {
		t.Errorf("fail-closed, plain namespace, agent gone: %v", err)
	}

	// The agent returns: the runtime's retries capture the waiting pods;
	// the recorded one is re-checked and stays outside the mesh.
	n.startAgent()
	poll.Until(t, "ADD spool re-checked", func() bool { e, _ := nodefiles.ListAdds(n.layout.AddSpool()); return len(e) == 0 })
	for _, p := range []*sandbox{late, api} {
		_ = n.del(p) // as the runtime does after a failed ADD
		if _, err := n.add(p); err != nil {
			t.Fatalf("retry after the agent returned: %v", err)
		}
		if !n.ourChains(t, p) {
			t.Errorf("pod that waited not captured on retry")
		}
	}
	if n.ourChains(t, plain) {
		t.Errorf("pod outside the mesh captured on the agent's return")
	}
}

// TestChainDelFIFONetns: a DEL whose CNI_NETNS names a FIFO returns (the
// CNI library's own netns check must not open it blocking), with the
// agent up and down.
func TestChainDelFIFONetns(t *testing.T) {
	n := newNode(t, "1.0.0", nil)
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, up := range []bool{true, false} {
		if !up {
			n.stopAgent()
		}
		s := n.newPod("shop", "fifo", nil)
		rt := s.rt()
		rt.NetNS = fifo
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := n.cni.DelNetworkList(ctx, n.list, rt)
		hung := ctx.Err() != nil
		cancel()
		if hung {
			t.Fatalf("DEL with a FIFO netns (agent up %v) hung", up)
		}
		t.Logf("DEL with a FIFO netns (agent up %v): %v", up, err)
	}
}

func TestChainStatusAndGC(t *testing.T) {
	n := newNode(t, "1.1.0", nil)
	ctx := context.Background()
	if err := n.cni.GetStatusNetworkList(ctx, n.list); err != nil {
		t.Errorf("STATUS: %v", err)
	}
	a, b := n.newPod("shop", "a", nil), n.newPod("shop", "b", nil)
	for _, s := range []*sandbox{a, b} {
		if _, err := n.add(s); err != nil {
			t.Fatal(err)
		}
	}
	// GC with only b valid: libcni DELs a from its cache, then GCs every
	// plugin; our GC makes the agent forget a even if the DEL was lost.
	if err := n.cni.GCNetworkList(ctx, n.list, &libcni.GCArgs{ValidAttachments: []types.GCAttachment{{ContainerID: b.id, IfName: "eth0"}}}); err != nil {
		t.Fatalf("GC: %v", err)
	}
	if p := n.agent.Pods(); len(p) != 1 || p[0].Name != "b" {
		t.Errorf("after GC: %+v", p)
	}
	n.stopAgent()
	if err := n.cni.GetStatusNetworkList(ctx, n.list); err != nil {
		t.Errorf("default STATUS with agent down must succeed: %v", err)
	}
	strict := newNode(t, "1.1.0", map[string]any{"statusRequiresAgent": true})
	if err := strict.cni.GetStatusNetworkList(ctx, strict.list); err != nil {
		t.Errorf("strict STATUS with agent up: %v", err)
	}
	strict.stopAgent()
	if err := strict.cni.GetStatusNetworkList(ctx, strict.list); cniCode(err) != types.ErrPluginNotAvailable {
		t.Errorf("strict STATUS with agent down: %v", err)
	}
}

func TestChainGCWithoutCachedDEL(t *testing.T) {
	n := newNode(t, "1.1.0", nil)
	a := n.newPod("shop", "a", nil)
	if _, err := n.add(a); err != nil {
		t.Fatal(err)
	}
	// Drop libcni's cache so GC reaches our plugin without a DEL first.
	if err := os.RemoveAll(filepath.Join(n.dir, "cache")); err != nil {
		t.Fatal(err)
	}
	if err := n.cni.GCNetworkList(context.Background(), n.list, &libcni.GCArgs{ValidAttachments: []types.GCAttachment{}}); err != nil {
		t.Fatalf("GC: %v", err)
	}
	if p := n.agent.Pods(); len(p) != 0 {
		t.Errorf("GC left %+v", p)
	}
}

func TestChainBadInput(t *testing.T) {
	n := newNode(t, "1.0.0", nil)
	s := n.newPod("shop", "web", nil)
	rt := s.rt()
	rt.Args = nil // a runtime that passes no Kubernetes args
	ctx := context.Background()
	_, err := n.cni.AddNetworkList(ctx, n.list, rt)
	t.Cleanup(func() { _ = n.cni.DelNetworkList(context.Background(), n.list, rt) })
	if cniCode(err) != types.ErrInvalidEnvironmentVariables || !strings.Contains(err.Error(), "K8S_POD_NAME") {
		t.Errorf("ADD without CNI_ARGS: %v", err)
	}
	// Malformed config straight to our binary.
	out, code := execPlugin(t, "ADD", s, []byte(`{"cniVersion":"1.0.0","name":"x","type":"ambient-cni","timeout":7}`))
	if code != types.ErrDecodingFailure || !strings.Contains(out, "decode ambient-cni config") {
		t.Errorf("malformed config: code %d, %s", code, out)
	}
	out, code = execPlugin(t, "ADD", s, []byte(`not json`))
	if code != types.ErrDecodingFailure {
		t.Errorf("garbage config: code %d, %s", code, out)
	}
	if len(n.agent.Pods()) != 0 || n.ourChains(t, s) {
		t.Errorf("bad input changed something")
	}
}

// execPlugin runs our binary directly and returns its stdout and CNI error
// code (0 on success).
func execPlugin(t *testing.T, cmd string, s *sandbox, stdin []byte) (string, uint) {
	t.Helper()
	c := exec.Command(cnibin.Plugin(t))
	c.Stdin = bytes.NewReader(stdin)
	c.Env = append([]string{}, []string{
		"CNI_COMMAND=" + cmd, "CNI_CONTAINERID=" + s.id, "CNI_NETNS=" + s.ns.Path(), "CNI_IFNAME=eth0", "CNI_PATH=/nonexistent",
		"CNI_ARGS=K8S_POD_NAMESPACE=" + s.namespace + ";K8S_POD_NAME=" + s.name,
	}...)
	out, err := c.Output()
	if err == nil {
		return string(out), 0
	}
	var e types.Error
	if json.Unmarshal(out, &e) != nil {
		t.Fatalf("plugin failed without a CNI error: %v\n%s", err, out)
	}
	return string(out), e.Code
}

// TestChainNoZtunnelIsRetryable: with the real ZDS server and no ztunnel
// connected, ADD of an enabled pod fails with code 11 once the bounded wait
// for ztunnel's ack runs out, with the rules already in place so the retry
// is cheap; a pass-through pod is not held up.
func TestChainNoZtunnelIsRetryable(t *testing.T) {
	n := newNode(t, "1.0.0", nil)
	n.stopAgent()
	zs := zds.NewServer(zds.Config{SocketPath: filepath.Join(n.dir, "zds", "ztunnel.sock")})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- zs.Serve(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	agent, err := nodeagent.NewAgent(nodeagent.Config{
		Rules: n.rules.Rules, Ztunnel: zs, ZtunnelTimeout: 300 * time.Millisecond,
		Layout: n.layout,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = agent.Close() })
	n.agent = agent
	n.startAgent()

	web := n.newPod("shop", "web", nil)
	_, err = n.add(web)
	if cniCode(err) != types.ErrTryAgainLater || !strings.Contains(err.Error(), "no ztunnel connected") {
		t.Fatalf("ADD with no ztunnel: %v", err)
	}
	if p := agent.Pods(); len(p) != 1 || p[0].State != nodeagent.StatePending {
		t.Errorf("state %+v, want the pod pending", p)
	}
	// The runtime tears the failed sandbox down with DEL.
	if err := n.del(web); err != nil || len(agent.Pods()) != 0 {
		t.Errorf("DEL after failed ADD: %v, state %+v", err, agent.Pods())
	}
	plain := n.newPod("plain", "db", nil)
	if _, err := n.add(plain); err != nil {
		t.Errorf("pass-through pod with no ztunnel: %v", err)
	}
}

// TestChainDelWithoutNetns: the runtime may call DEL after the netns is
// gone (CNI_NETNS empty); the agent forgets the pod all the same.
func TestChainDelWithoutNetns(t *testing.T) {
	n := newNode(t, "1.0.0", nil)
	web := n.newPod("shop", "web", nil)
	if _, err := n.add(web); err != nil {
		t.Fatal(err)
	}
	rt := web.rt()
	rt.NetNS = ""
	if err := n.cni.DelNetworkList(context.Background(), n.list, rt); err != nil {
		t.Fatalf("DEL without netns: %v", err)
	}
	if p := n.agent.Pods(); len(p) != 0 {
		t.Errorf("state after DEL without netns: %+v", p)
	}
}

// TestChainPrevResultOfAnotherVersion: a primary plugin that answers in
// another CNI version than the conflist's (an older plugin answering
// 0.4.0 under a 1.1.0 list, or the reverse) is no reason to keep the pod
// from starting: through libcni, our plugin reads that prevResult by its
// own version, enrolls the pod with its addresses, and prints it converted
// to the list's version, as docs/cni-plugin.md says.
func TestChainPrevResultOfAnotherVersion(t *testing.T) {
	for _, c := range []struct{ list, primary string }{
		{"1.1.0", "0.4.0"}, {"1.0.0", "0.3.1"}, {"0.4.0", "1.1.0"}, {"0.3.1", "1.0.0"},
	} {
		t.Run(c.primary+"-under-"+c.list, func(t *testing.T) {
			n := newNode(t, c.list, nil)
			n.rec.answerIn("bridge", c.primary)
			web := n.newPod("shop", "web", nil)
			res, err := n.add(web)
			if err != nil {
				t.Fatalf("ADD with a %s prevResult under a %s list: %v", c.primary, c.list, err)
			}
			var shape struct {
				CNIVersion string `json:"cniVersion"`
			}
			if err := json.Unmarshal(n.rec.last("bridge"), &shape); err != nil || shape.CNIVersion != c.primary {
				t.Fatalf("the primary answered %s (%v), want %s", n.rec.last("bridge"), err, c.primary)
			}
			if err := json.Unmarshal(n.rec.last("ambient-cni"), &shape); err != nil || shape.CNIVersion != c.list || res.Version() != c.list {
				t.Fatalf("our result %s (%v), want it in the list's version %s", n.rec.last("ambient-cni"), err, c.list)
			}
			want, err := resultAs(n.rec.last("bridge"), c.list)
			if err != nil {
				t.Fatal(err)
			}
			if !sameJSON(t, n.rec.last("ambient-cni"), want) {
				t.Errorf("our result is not the prevResult converted:\nours: %s\nwant: %s", n.rec.last("ambient-cni"), want)
			}
			if p := n.agent.Pods(); len(p) != 1 || len(p[0].IPs) != 2 || !n.ourChains(t, web) {
				t.Errorf("pod not enrolled with its two addresses: %+v", p)
			}
		})
	}
}

// TestChainBadNetnsIsTheCallers: a runtime that hands the chain a netns
// path the agent may not use (here a real namespace the bridge set up,
// but bind-mounted outside the runtime's netns directories) gets CNI error
// 4, naming its CNI_NETNS, not an internal error of ours; nothing is
// installed.
func TestChainBadNetnsIsTheCallers(t *testing.T) {
	n := newNode(t, "1.0.0", nil)
	s := n.newPod("shop", "web", nil)
	elsewhere := filepath.Join(t.TempDir(), "pod-ns")
	if err := os.WriteFile(elsewhere, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(s.ns.Path(), elsewhere, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("bind-mount the pod netns: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(elsewhere, unix.MNT_DETACH) })
	rt := s.rt()
	rt.NetNS = elsewhere
	ctx := context.Background()
	_, err := n.cni.AddNetworkList(ctx, n.list, rt)
	t.Cleanup(func() { _ = n.cni.DelNetworkList(context.Background(), n.list, rt) })
	if cniCode(err) != types.ErrInvalidEnvironmentVariables || !strings.Contains(err.Error(), "rejected ADD as invalid") ||
		!strings.Contains(err.Error(), "not under an allowed root") {
		t.Errorf("ADD with a netns outside the runtime's directories: %v; want CNI error 4 naming the path", err)
	}
	if len(n.agent.Pods()) != 0 || n.ourChains(t, s) {
		t.Errorf("rejected ADD installed something")
	}
}
