//go:build realnode

package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/explainwire"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/pkg/verifier"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// e2eVerifyPeriod is the verifier's period in testVerifier only: each
// tamper must be found within one period, and the shipped minute would
// make four tampers take minutes of waiting. The shipped default is pinned
// by TestVerifierShippedPeriod (test/integration) and restored at the end.
const e2eVerifyPeriod = 5 * time.Second

// verifierNS is testVerifier's ambient namespace.
const verifierNS = "verify"

// testVerifier tampers with a captured pod from the host, one way at a
// time, as another tool or a failure would: its rules flushed, the
// stand-in's listeners in it closed, its probe-set entry deleted, and its
// sandbox recreated while the primary CNI's conflist lacks our entry. Each
// is found by the first proof after it (so within one period), repaired,
// and reported: a Warning Event on the pod naming the kind, the drift
// counter of the kind, and explain's last verification; the unproven
// gauge returns to 0 and the other pod is never found drifted.
func (e *e2e) testVerifier(t *testing.T) {
	ctx := context.Background()
	n := e.n
	e.setVerifyPeriod(t, e2eVerifyPeriod.String(), "--set", "agent.verifyPeriod="+e2eVerifyPeriod.String())
	t.Cleanup(func() {
		// The chart's default again, for the tests after this one.
		e.setVerifyPeriod(t, verifier.DefaultPeriod.String())
	})
	rolled := time.Now()

	e.namespace(t, verifierNS, true)
	target := e.start(t, verifierNS, "target", AppOptions{})
	other := e.start(t, verifierNS, "bystander", AppOptions{})
	e.mustCaptured(t, target)
	e.mustCaptured(t, other)
	for _, p := range []*corev1.Pod{target, other} {
		if err := n.Poll(ctx, p.Name+" proven", func(ctx context.Context) (bool, error) {
			v, err := e.verification(ctx, p.Name)
			if err != nil {
				return false, err
			}
			if !v.At.After(rolled) || !v.Proven {
				return false, fmt.Errorf("last proof %+v", v)
			}
			return true, nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	e.unprovenZero(t)

	for _, c := range []struct {
		kind verifier.Kind
		// or is another kind the same tamper may show as.
		or verifier.Kind
		// tamper returns the time the drift began.
		tamper   func(t *testing.T) time.Time
		repaired func(ctx context.Context) (bool, error)
	}{
		{verifier.KindRules, "", func(t *testing.T) time.Time {
			e.flushPodRules(t, target)
			return time.Now()
		}, func(ctx context.Context) (bool, error) {
			rules, err := n.PodRules(ctx, verifierNS, target.Name)
			if err != nil || !HasCaptureRules(rules) {
				return false, fmt.Errorf("no capture rules in the pod (%v)", err)
			}
			r, err := e.explainPod(ctx, target.Name)
			if err != nil || r.Captured == nil || !r.Captured.Rules.Clean {
				return false, fmt.Errorf("explain: rules not clean (%v)", err)
			}
			return true, nil
		}},
		{verifier.KindZtunnel, "", func(t *testing.T) time.Time {
			if err := n.standInCloseListeners(ctx, string(target.UID)); err != nil {
				t.Fatal(err)
			}
			return time.Now()
		}, func(ctx context.Context) (bool, error) { return e.standInListens(ctx, target) }},
		{verifier.KindProbeSet, "", func(t *testing.T) time.Time {
			deleteProbeEntry(t, target.Status.PodIP)
			return time.Now()
		}, func(ctx context.Context) (bool, error) { return inHostProbeSet(target.Status.PodIP) }},
		// Either drift proves the new sandbox came up without the plugin:
		// an ADD through it would have moved the agent to the new
		// namespace, leaving nothing to find. The old sandbox's DEL, run
		// once the installer put our entry back, releases the pod; the
		// new sandbox is then found uncaptured rather than moved.
		{verifier.KindSandbox, verifier.KindUncaptured, func(t *testing.T) time.Time {
			return e.recreateSandboxUnchained(t, target)
		}, func(ctx context.Context) (bool, error) {
			p, err := n.Client.CoreV1().Pods(verifierNS).Get(ctx, target.Name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			if ok, err := n.captured(ctx, p); !ok {
				return false, err
			}
			if ok, err := e.standInListens(ctx, p); !ok {
				return false, err
			}
			return inHostProbeSet(p.Status.PodIP)
		}},
	} {
		t.Run(string(c.kind), func(t *testing.T) {
			kinds := []verifier.Kind{c.kind}
			if c.or != "" {
				kinds = append(kinds, c.or)
			}
			drifts := func() float64 {
				n := 0.0
				for _, k := range kinds {
					n += e.metric(t, fmt.Sprintf(`ambient_cni_verify_drift_total{kind=%q}`, k))
				}
				return n
			}
			counted := drifts()
			otherBefore, err := e.verification(ctx, other.Name)
			if err != nil {
				t.Fatal(err)
			}
			begin := time.Now()
			tampered := c.tamper(t)
			var missed []string
			var found, repaired time.Time
			var last explainwire.Verification
			err = n.Poll(ctx, string(c.kind)+" drift found and repaired", func(ctx context.Context) (bool, error) {
				v, err := e.verification(ctx, target.Name)
				if err != nil {
					return false, err
				}
				last = v
				drifted := v.LastDriftAt != nil && v.LastDriftAt.After(tampered) && slices.ContainsFunc(kinds, func(k verifier.Kind) bool { return hasKind(v.LastDrift, k) })
				// A proof begun after the tamper that found nothing wrong
				// missed it: drift must be found within one period.
				if found.IsZero() && !drifted && v.At.After(tampered) && len(v.Found) == 0 {
					missed = append(missed, fmt.Sprintf("%+v", v))
				}
				if drifted && found.IsZero() {
					found = *v.LastDriftAt
				}
				if !drifted || !v.Proven || v.At.Before(*v.LastDriftAt) {
					return false, fmt.Errorf("last proof %+v", v)
				}
				ok, err := c.repaired(ctx)
				if ok && repaired.IsZero() {
					repaired = time.Now()
				}
				return ok, err
			})
			if err != nil {
				t.Fatalf("%v\n%s", err, n.AgentLogTail(ctx, 150))
			}
			if len(missed) > 0 {
				t.Errorf("proofs begun after the tamper found no %s drift:\n%s", c.kind, strings.Join(missed, "\n"))
			}
			t.Logf("FIGURE verifier-%s: found %v after the tamper, repaired %v after it (period %v; tamper took %v); proof %+v",
				c.kind, found.Sub(tampered).Round(time.Millisecond), repaired.Sub(tampered).Round(time.Millisecond),
				e2eVerifyPeriod, tampered.Sub(begin).Round(time.Millisecond), last)
			if err := n.Poll(ctx, "a Warning Event naming "+string(c.kind), func(ctx context.Context) (bool, error) {
				evs, err := n.PodEvents(ctx, verifierNS, target.Name)
				if err != nil {
					return false, err
				}
				for _, ev := range evs {
					if ev.Type == corev1.EventTypeWarning && ev.Reason == verifier.ReasonDrift && ev.InvolvedObject.UID == target.UID &&
						slices.ContainsFunc(kinds, func(k verifier.Kind) bool { return strings.Contains(ev.Message, string(k)+":") }) &&
						!eventTime(ev).Before(begin.Truncate(time.Second)) {
						t.Logf("Event %s: %s", ev.Reason, ev.Message)
						return true, nil
					}
				}
				return false, fmt.Errorf("%d events on the pod, none %s naming %s since the tamper", len(evs), verifier.ReasonDrift, c.kind)
			}); err != nil {
				t.Error(err)
			}
			if got := drifts(); got <= counted {
				t.Errorf("ambient_cni_verify_drift_total of %v = %v, was %v before the tamper", kinds, got, counted)
			}
			e.unprovenZero(t)
			if v, err := e.verification(ctx, other.Name); err != nil || !v.Proven || !sameTime(v.LastDriftAt, otherBefore.LastDriftAt) {
				t.Errorf("the untouched pod: %+v (%v); before the tamper %+v", v, err, otherBefore)
			}
		})
	}
}

// setVerifyPeriod upgrades the chart with extra values and waits until
// the agent pod runs with the verify period want, is ready, and a ztunnel
// is connected to it again.
func (e *e2e) setVerifyPeriod(t *testing.T, want string, extra ...string) {
	t.Helper()
	ctx := context.Background()
	if err := e.n.InstallAgent(ctx, "upgrade", ImageTag, extra...); err != nil {
		t.Fatalf("helm upgrade: %v", err)
	}
	err := e.n.Poll(ctx, "agent with verify period "+want, func(ctx context.Context) (bool, error) {
		pods, err := e.n.AgentPods(ctx)
		if err != nil || len(pods) != 1 {
			return false, fmt.Errorf("%d agent pods (%v)", len(pods), err)
		}
		p := pods[0]
		env := ""
		for _, v := range p.Spec.Containers[0].Env {
			if v.Name == "AMBIENT_VERIFY_PERIOD" {
				env = v.Value
			}
		}
		if d, err := time.ParseDuration(env); err != nil || d.String() != want || p.DeletionTimestamp != nil || !isReady(&p) {
			return false, fmt.Errorf("agent %s: AMBIENT_VERIFY_PERIOD=%q ready=%v", p.Name, env, isReady(&p))
		}
		if _, err := e.n.AgentGet(ctx, "/readyz"); err != nil {
			return false, err
		}
		return true, nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// explainPod asks the agent's explain about a pod of verifierNS.
func (e *e2e) explainPod(ctx context.Context, name string) (*explainwire.Report, error) {
	return e.explainIn(ctx, verifierNS, name)
}

// explainIn asks the agent's explain about a pod.
func (e *e2e) explainIn(ctx context.Context, ns, name string) (*explainwire.Report, error) {
	b, err := e.n.AgentGet(ctx, "/debug/explain?pod="+url.QueryEscape(ns+"/"+name))
	if err != nil {
		return nil, err
	}
	var r explainwire.Report
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("decode explain: %w: %s", err, b)
	}
	return &r, nil
}

// verification is explain's last verification of a pod of verifierNS.
func (e *e2e) verification(ctx context.Context, name string) (explainwire.Verification, error) {
	return e.verificationIn(ctx, verifierNS, name)
}

// verificationIn is explain's last verification of a pod.
func (e *e2e) verificationIn(ctx context.Context, ns, name string) (explainwire.Verification, error) {
	r, err := e.explainIn(ctx, ns, name)
	if err != nil {
		return explainwire.Verification{}, err
	}
	if r.Captured == nil || r.Captured.Verification == nil {
		return explainwire.Verification{}, fmt.Errorf("explain shows no verification: %s", r.Verdict)
	}
	return *r.Captured.Verification, nil
}

func hasKind(findings []string, k verifier.Kind) bool {
	return slices.ContainsFunc(findings, func(s string) bool { return strings.HasPrefix(s, string(k)+":") })
}

func sameTime(a, b *time.Time) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return a.Equal(*b)
}

// eventTime is when an Event last happened.
func eventTime(ev corev1.Event) time.Time {
	if !ev.LastTimestamp.IsZero() {
		return ev.LastTimestamp.Time
	}
	if ev.Series != nil {
		return ev.Series.LastObservedTime.Time
	}
	return ev.EventTime.Time
}

// metric reads one series of the agent's /metrics (0 when absent).
func (e *e2e) metric(t *testing.T, series string) float64 {
	t.Helper()
	b, err := e.n.AgentGet(context.Background(), "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("%s: %v", line, err)
			}
			return f
		}
	}
	return 0
}

// unprovenZero waits until the agent's unproven gauge is 0.
func (e *e2e) unprovenZero(t *testing.T) {
	t.Helper()
	const series = "ambient_cni_pods_unproven"
	if err := e.n.Poll(context.Background(), series+" at 0", func(ctx context.Context) (bool, error) {
		b, err := e.n.AgentGet(ctx, "/metrics")
		if err != nil {
			return false, err
		}
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, series+" "); ok {
				if strings.TrimSpace(v) == "0" {
					return true, nil
				}
				return false, fmt.Errorf("%s", line)
			}
		}
		return false, fmt.Errorf("no %s in /metrics", series)
	}); err != nil {
		t.Error(err)
	}
}

// flushPodRules flushes the agent's rules in a pod's netns from the
// host, as another tool flushing the tables would, with the tool of the
// backend explain names.
func (e *e2e) flushPodRules(t *testing.T, p *corev1.Pod) {
	t.Helper()
	ctx := context.Background()
	r, err := e.explainPod(ctx, p.Name)
	if err != nil || r.Captured == nil {
		t.Fatalf("explain %s: %v", p.Name, err)
	}
	netnsPath, err := e.n.PodNetns(ctx, p.Namespace, p.Name)
	if err != nil {
		t.Fatal(err)
	}
	var cmds [][]string
	switch b := r.Captured.Rules.Backend; {
	case b == "nftables":
		cmds = append(cmds, []string{"nft", "flush", "ruleset"})
	case strings.HasPrefix(b, "iptables-"):
		flavour := strings.TrimPrefix(b, "iptables-")
		for _, bin := range []string{"iptables-" + flavour, "ip6tables-" + flavour} {
			for _, table := range []string{"nat", "mangle"} {
				cmds = append(cmds, []string{bin, "-t", table, "-F"})
			}
		}
	default:
		t.Fatalf("explain names no rules backend: %+v", r.Captured.Rules)
	}
	for _, c := range cmds {
		if out, err := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + netnsPath}, c...)...).CombinedOutput(); err != nil {
			t.Fatalf("%s in the pod: %v: %s", strings.Join(c, " "), err, out)
		}
	}
	t.Logf("flushed the pod's rules (%s backend) from the host", r.Captured.Rules.Backend)
}

// standInCloseListeners has the stand-in close its in-pod listeners of
// one pod, as a ztunnel that lost them while still serving the pod.
func (n *Node) standInCloseListeners(ctx context.Context, uid string) error {
	return n.standInFault(ctx, http.MethodPost, "/close-listeners", uid)
}

// standInFault sends one of the stand-in's fault requests about a pod.
func (n *Node) standInFault(ctx context.Context, method, path, uid string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, fmt.Sprintf("http://127.0.0.1:%d%s?uid=%s", n.standInPort, path, url.QueryEscape(uid)), nil)
	if err != nil {
		return err
	}
	resp, err := noKeepAlive.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		return fmt.Errorf("stand-in %s %s %s: %s", method, path, uid, resp.Status)
	}
	return nil
}

// standInListens reports whether the stand-in serves p at its current IP
// with all three in-pod listeners.
func (e *e2e) standInListens(ctx context.Context, p *corev1.Pod) (bool, error) {
	wls, err := e.n.StandInWorkloads(ctx)
	if err != nil {
		return false, err
	}
	for _, w := range wls {
		if w.UID != string(p.UID) {
			continue
		}
		if !slices.ContainsFunc(w.IPs, func(a netip.Addr) bool { return a.String() == p.Status.PodIP }) {
			return false, fmt.Errorf("the stand-in serves the pod at %v, not %s", w.IPs, p.Status.PodIP)
		}
		for _, port := range []int{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort, ambient.ZtunnelInboundHBONEPort} {
			if !slices.Contains(w.Ports, port) {
				return false, fmt.Errorf("the stand-in has no listener on %d in the pod (%v)", port, w.Ports)
			}
		}
		return true, nil
	}
	return false, fmt.Errorf("the stand-in does not serve the pod")
}

// deleteProbeEntry deletes ip from the host probe set: the agent's
// nftables set, or the ipset of the iptables backends.
func deleteProbeEntry(t *testing.T, ip string) {
	t.Helper()
	if _, err := runOut("nft", "list", "set", "inet", nftables.TableHost, ruleset.ProbeSetV4); err == nil {
		if out, err := runOut("nft", "delete", "element", "inet", nftables.TableHost, ruleset.ProbeSetV4, "{ "+ip+" }"); err != nil {
			t.Fatalf("nft delete element: %v: %s", err, out)
		}
		t.Logf("deleted %s from the nftables set %s", ip, ruleset.ProbeSetV4)
		return
	}
	if out, err := runOut("ipset", "del", ruleset.ProbeSetV4, ip); err != nil {
		t.Fatalf("ipset del: %v: %s", err, out)
	}
	t.Logf("deleted %s from the ipset %s", ip, ruleset.ProbeSetV4)
}

func inHostProbeSet(ip string) (bool, error) {
	members, _, err := hostProbeSet()
	if err != nil {
		return false, err
	}
	if !slices.Contains(members, ip) {
		return false, fmt.Errorf("the host probe set lacks %s (%v)", ip, members)
	}
	return true, nil
}

// recreateSandboxUnchained removes our entry from the primary conflist
// and holds it out while the pod's sandbox is stopped and removed and
// kubelet creates a new one: the new sandbox comes up without the plugin,
// and only the verifier can find it. The sandbox is stopped only once
// containerd itself has loaded the unchained list: a rewrite raced against
// the installer's repairs could lose, under load, to a repair containerd
// loaded just before the ADD, and the new sandbox would be captured by the
// plugin, leaving nothing to find. It returns when the new sandbox exists,
// the entry no longer held out.
func (e *e2e) recreateSandboxUnchained(t *testing.T, p *corev1.Pod) time.Time {
	t.Helper()
	ctx := context.Background()
	n := e.n
	old, err := n.SandboxID(ctx, p.Namespace, p.Name)
	if err != nil {
		t.Fatal(err)
	}
	release := e.holdUnchained(t)
	defer release()
	if err := n.Poll(ctx, "containerd loads the unchained conflist", func(ctx context.Context) (bool, error) {
		if err := pluginInstalled(n); err == nil {
			return false, fmt.Errorf("the conflist chains ambient-cni")
		}
		chained, err := e.runtimeChains(ctx)
		if err != nil || chained {
			return false, fmt.Errorf("containerd's loaded CNI config chains ambient-cni: %v (%v)", chained, err)
		}
		return true, nil
	}); err != nil {
		t.Fatal(err)
	}
	tampered := time.Now()
	for _, c := range [][]string{{"stopp", old}, {"rmp", old}} {
		if _, err := n.crictl(ctx, c...); err != nil {
			t.Fatalf("crictl %s: %v", strings.Join(c, " "), err)
		}
	}
	var id string
	if err := n.Poll(ctx, "kubelet recreates the sandbox", func(ctx context.Context) (bool, error) {
		id, err = n.SandboxID(ctx, p.Namespace, p.Name)
		return err == nil && id != old, err
	}); err != nil {
		t.Fatal(err)
	}
	t.Logf("sandbox %s recreated as %s while unchained (%v after the stop)", old[:12], id[:12], time.Since(tampered).Round(time.Millisecond))
	rules, err := n.PodRules(ctx, p.Namespace, p.Name)
	if err == nil && HasCaptureRules(rules) {
		// The verifier may already have captured it; the drift reported
		// tells.
		t.Logf("the new sandbox already has capture rules")
	}
	return tampered
}

// holdUnchained writes the primary's conflist without our entry and keeps
// the installer from putting it back, until release: the conf directory
// is made immutable (chattr +i), which refuses the installer's temp file
// and rename, and the file is then rewritten in place, as a primary CNI's
// agent would. Release (also a cleanup) lifts the attribute; the installer
// repairs the list on its next try.
func (e *e2e) holdUnchained(t *testing.T) (release func()) {
	t.Helper()
	n := e.n
	dir := n.CNIConfDir
	var once sync.Once
	release = func() {
		once.Do(func() {
			if out, err := exec.Command("chattr", "-i", dir).CombinedOutput(); err != nil {
				t.Errorf("chattr -i %s: %v: %s", dir, err, out)
			}
		})
	}
	if out, err := exec.Command("chattr", "+i", dir).CombinedOutput(); err != nil {
		testnet.Missing(t, fmt.Sprintf("chattr +i on the node's CNI conf dir: %v: %s", err, out))
	}
	t.Cleanup(release)
	if err := os.WriteFile(n.CNIConfFile, n.CNIConfOriginal, 0o644); err != nil {
		t.Fatalf("rewrite the primary conflist in place: %v", err)
	}
	return release
}

// runtimeChains says whether the CNI config containerd has loaded (crictl
// info's cniconfig, what its next ADD runs) has a plugin of type
// ambient-cni, and fails while containerd's last load did not succeed.
func (e *e2e) runtimeChains(ctx context.Context) (bool, error) {
	info, err := e.runtimeInfo(ctx)
	if err != nil {
		return false, err
	}
	if info.LastCNILoadStatus != "" && info.LastCNILoadStatus != "OK" {
		return false, fmt.Errorf("containerd's last CNI config load: %s", info.LastCNILoadStatus)
	}
	raw := info.CNIConfig
	var s string
	if json.Unmarshal(raw, &s) == nil { // a runtime that passes it on as a string
		raw = json.RawMessage(s)
	}
	var conf struct {
		Networks []struct {
			Config struct {
				Plugins []struct {
					Network struct {
						Type string `json:"type"`
					}
				}
			}
		}
	}
	if err := json.Unmarshal(raw, &conf); err != nil {
		return false, fmt.Errorf("crictl info's cniconfig: %w", err)
	}
	primary, chained := false, false
	for _, nw := range conf.Networks {
		for _, pl := range nw.Config.Plugins {
			primary = primary || pl.Network.Type != "loopback"
			chained = chained || pl.Network.Type == "ambient-cni"
		}
	}
	if !primary {
		return false, fmt.Errorf("containerd has no CNI network but the loopback loaded: %s", raw)
	}
	return chained, nil
}
