package realnode

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
	"github.com/ambient-cni/ambient-cni/test/realnode/podapp"
)

// DemoNamespace is where the story's app pods run.
const DemoNamespace = "demo"

// Proof is one claim the story checked.
type Proof struct {
	Step, Claim string
	Err         error
}

// Story plays issue 13's demo on a node with the agent and the stand-in
// installed, checking a proof at each step. The end-to-end tests run the
// same steps and assert every proof.
type Story struct {
	N      *Node
	Out    io.Writer
	Proofs []Proof
	// Istiod, when set, adds istiod's view of each pod to the table.
	Istiod *Istiod

	step  string
	seq   int
	pods  map[string]*corev1.Pod
	order []string
}

func (s *Story) say(format string, args ...any) {
	if s.Out != nil {
		fmt.Fprintf(s.Out, format+"\n", args...)
	}
}

// check records a proof and prints it.
func (s *Story) check(claim string, err error) bool {
	s.Proofs = append(s.Proofs, Proof{Step: s.step, Claim: claim, Err: err})
	if err != nil {
		s.say("   FAIL  %s: %v", claim, err)
		return false
	}
	s.say("   ok    %s", claim)
	return true
}

// Failed lists the proofs that failed.
func (s *Story) Failed() []Proof {
	var out []Proof
	for _, p := range s.Proofs {
		if p.Err != nil {
			out = append(out, p)
		}
	}
	return out
}

func (s *Story) begin(title string) {
	s.step = title
	s.say("\n== %s", title)
}

// Run plays every step. It returns an error only when the story cannot go
// on; failed proofs are in Proofs.
func (s *Story) Run(ctx context.Context) error {
	s.pods = map[string]*corev1.Pod{}
	steps := []func(context.Context) error{s.stepDirect, s.stepEnroll, s.stepNewPod, s.stepOptOut, s.stepUnlabel}
	for _, f := range steps {
		if err := f(ctx); err != nil {
			s.check("step could go on", err)
			return err
		}
	}
	return nil
}

// startApp creates an app pod in the demo namespace and waits until it is
// Ready.
func (s *Story) startApp(ctx context.Context, name string, o AppOptions) (*corev1.Pod, error) {
	pod := s.N.AppPod(DemoNamespace, name, o)
	if _, err := s.N.Client.CoreV1().Pods(DemoNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return nil, err
	}
	p, err := s.N.WaitPodReady(ctx, DemoNamespace, name)
	if err != nil {
		return nil, err
	}
	s.pods[name] = p
	s.order = append(s.order, name)
	return p, nil
}

func appURL(p *corev1.Pod, path string) string {
	return fmt.Sprintf("http://%s:%d%s", p.Status.PodIP, AppPort, path)
}

// request makes from pod a GET to pod b (through a's /fetch) with a unique
// marker path and returns the marker.
func (s *Story) request(ctx context.Context, from, to string) (string, error) {
	s.seq++
	marker := fmt.Sprintf("/req-%d-%s-to-%s", s.seq, from, to)
	a, b := s.pods[from], s.pods[to]
	body, err := httpGet(ctx, appURL(a, "/fetch?url="+url.QueryEscape(appURL(b, marker))))
	if err != nil {
		return marker, err
	}
	var res podapp.FetchResult
	if err := json.Unmarshal(body, &res); err != nil {
		return marker, err
	}
	if res.Err != "" || res.Status != 200 || strings.TrimSpace(res.Body) != to {
		return marker, fmt.Errorf("%s → %s: status %d body %q err %q", from, to, res.Status, res.Body, res.Err)
	}
	return marker, nil
}

// appLog reads a pod's request log.
func appLog(ctx context.Context, p *corev1.Pod) ([]podapp.Entry, error) {
	b, err := httpGet(ctx, appURL(p, "/log"))
	if err != nil {
		return nil, err
	}
	var entries []podapp.Entry
	return entries, json.Unmarshal(b, &entries)
}

// seenFrom returns the remote address a pod's log has for a path.
func seenFrom(ctx context.Context, p *corev1.Pod, path string) (netip.Addr, error) {
	entries, err := appLog(ctx, p)
	if err != nil {
		return netip.Addr{}, err
	}
	for _, e := range entries {
		if e.Path == path {
			ap, err := netip.ParseAddrPort(e.Remote)
			if err != nil {
				return netip.Addr{}, err
			}
			return ap.Addr(), nil
		}
	}
	return netip.Addr{}, fmt.Errorf("%s never got %s", p.Name, path)
}

// ring is the three pods' request ring of steps 1, 2 and 5.
var ring = [][2]string{{"app-1", "app-2"}, {"app-2", "app-3"}, {"app-3", "app-1"}}

// recordsOf returns the stand-in's records of one pod.
func recordsOf(recs []ztunnel.Record, uid types.UID) []ztunnel.Record {
	var out []ztunnel.Record
	for _, r := range recs {
		if r.UID == string(uid) {
			out = append(out, r)
		}
	}
	return out
}

// directRing makes the ring requests and proves each went directly: the
// target saw the source pod's address and the stand-in recorded nothing.
func (s *Story) directRing(ctx context.Context) {
	before, err := s.N.StandInRecords(ctx)
	if err != nil {
		s.check("stand-in answers", err)
		return
	}
	for _, pair := range ring {
		from, to := pair[0], pair[1]
		marker, err := s.request(ctx, from, to)
		if !s.check(fmt.Sprintf("%s → %s answered", from, to), err) {
			continue
		}
		src, err := seenFrom(ctx, s.pods[to], marker)
		if err == nil && src.String() != s.pods[from].Status.PodIP {
			err = fmt.Errorf("%s saw the request from %s, want %s's own address %s", to, src, from, s.pods[from].Status.PodIP)
		}
		s.check(fmt.Sprintf("%s → %s went directly (%s saw %s)", from, to, to, src), err)
	}
	after, err := s.N.StandInRecords(ctx)
	if err == nil && len(after) != len(before) {
		err = fmt.Errorf("the stand-in proxied %d connections: %+v", len(after)-len(before), after[len(before):])
	}
	s.check("the stand-in proxied none of them", err)
}

// capturedRing makes the ring requests and proves each went through the
// stand-in: out of the source on 15001, tunneled into the target's 15008.
func (s *Story) capturedRing(ctx context.Context) {
	for _, pair := range ring {
		from, to := pair[0], pair[1]
		marker, err := s.request(ctx, from, to)
		if !s.check(fmt.Sprintf("%s → %s answered", from, to), err) {
			continue
		}
		a, b := s.pods[from], s.pods[to]
		dst := netip.AddrPortFrom(netip.MustParseAddr(b.Status.PodIP), AppPort)
		err = s.N.Poll(ctx, "stand-in records", func(ctx context.Context) (bool, error) {
			recs, err := s.N.StandInRecords(ctx)
			if err != nil {
				return false, err
			}
			out, in := false, false
			for _, r := range recordsOf(recs, a.UID) {
				out = out || (r.Port == ambient.ZtunnelOutboundPort && r.OrigDst == dst && r.Tunneled && r.Err == "")
			}
			for _, r := range recordsOf(recs, b.UID) {
				in = in || (r.Port == ambient.ZtunnelInboundHBONEPort && r.OrigDst == dst && r.Err == "")
			}
			if !out || !in {
				return false, fmt.Errorf("outbound record of %s: %v, tunnel record of %s: %v", from, out, to, in)
			}
			return true, nil
		})
		s.check(fmt.Sprintf("%s → %s went %s:15001 → %s:15008 in the stand-in's log", from, to, from, to), err)
		src, err := seenFrom(ctx, b, marker)
		if err == nil && src.String() != b.Status.PodIP {
			err = fmt.Errorf("%s saw the request from %s, want its own address (delivered by the stand-in inside it)", to, src)
		}
		s.check(fmt.Sprintf("%s got it from the stand-in inside it (%s)", to, src), err)
	}
}

func (s *Story) stepDirect(ctx context.Context) error {
	s.begin("1. three app pods in namespace demo (not enabled): requests flow directly")
	if err := s.N.CreateNamespace(ctx, DemoNamespace, nil); err != nil {
		return err
	}
	for _, name := range []string{"app-1", "app-2", "app-3"} {
		p, err := s.startApp(ctx, name, AppOptions{})
		if err != nil {
			return err
		}
		s.say("   %s Running and Ready at %s", name, p.Status.PodIP)
	}
	for _, name := range []string{"app-1", "app-2", "app-3"} {
		s.checkReleased(ctx, name, "not captured")
	}
	s.directRing(ctx)
	return nil
}

// checkReleased proves a pod is not captured: no annotation, no rules in
// its netns, not served by the stand-in, not in the agent's state.
func (s *Story) checkReleased(ctx context.Context, name, what string) {
	p := s.pods[name]
	err := s.N.Poll(ctx, name+" released", func(ctx context.Context) (bool, error) {
		return s.N.released(ctx, p)
	})
	s.check(fmt.Sprintf("%s %s: no annotation, no rules in its netns, unknown to the stand-in", name, what), err)
}

// released is true when a pod has no trace of capture.
func (n *Node) released(ctx context.Context, p *corev1.Pod) (bool, error) {
	return n.releasedFrom(ctx, p, n.standInPort != 0)
}

// releasedFrom is released, asking the stand-in only when withStandIn.
func (n *Node) releasedFrom(ctx context.Context, p *corev1.Pod, withStandIn bool) (bool, error) {
	cur, err := n.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	if v, ok := cur.Annotations[ambient.RedirectionAnnotation]; ok {
		return false, fmt.Errorf("annotation %s=%s", ambient.RedirectionAnnotation, v)
	}
	rules, err := n.PodRules(ctx, p.Namespace, p.Name)
	if err != nil {
		return false, err
	}
	if HasCaptureRules(rules) {
		return false, errors.New("capture rules in its netns")
	}
	if withStandIn {
		wls, err := n.StandInWorkloads(ctx)
		if err != nil {
			return false, err
		}
		for _, w := range wls {
			if w.UID == string(p.UID) {
				return false, errors.New("the stand-in still serves it")
			}
		}
	}
	return true, nil
}

// captured is true when a pod is fully enrolled: annotation enabled, rules
// in its netns, served by the stand-in with listeners.
func (n *Node) captured(ctx context.Context, p *corev1.Pod) (bool, error) {
	cur, err := n.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil {
		return false, err
	}
	if v := cur.Annotations[ambient.RedirectionAnnotation]; v != ambient.RedirectionEnabled {
		return false, fmt.Errorf("annotation %s=%q", ambient.RedirectionAnnotation, v)
	}
	rules, err := n.PodRules(ctx, p.Namespace, p.Name)
	if err != nil {
		return false, err
	}
	if !HasCaptureRules(rules) {
		return false, errors.New("no capture rules in its netns")
	}
	wls, err := n.StandInWorkloads(ctx)
	if err != nil {
		return false, err
	}
	for _, w := range wls {
		if w.UID == string(p.UID) {
			for _, port := range []int{ambient.ZtunnelOutboundPort, ambient.ZtunnelInboundPlaintextPort, ambient.ZtunnelInboundHBONEPort} {
				if !slices.Contains(w.Ports, port) {
					return false, fmt.Errorf("stand-in has no listener on %d in it", port)
				}
			}
			return true, nil
		}
	}
	return false, errors.New("the stand-in does not serve it")
}

func (s *Story) checkCaptured(ctx context.Context, name string) {
	p := s.pods[name]
	err := s.N.Poll(ctx, name+" captured", func(ctx context.Context) (bool, error) {
		return s.N.captured(ctx, p)
	})
	s.check(fmt.Sprintf("%s enrolled: annotation %s=enabled, rules in its netns, stand-in listeners 15001/15006/15008", name, ambient.RedirectionAnnotation), err)
}

func (s *Story) label(ctx context.Context, value string) error {
	var patch string
	if value == "" {
		patch = fmt.Sprintf(`{"metadata":{"labels":{%q:null}}}`, ambient.DataplaneModeLabel)
	} else {
		patch = fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, ambient.DataplaneModeLabel, value)
	}
	_, err := s.N.Client.CoreV1().Namespaces().Patch(ctx, DemoNamespace, types.MergePatchType, []byte(patch), metav1.PatchOptions{})
	return err
}

func (s *Story) stepEnroll(ctx context.Context) error {
	s.begin("2. label namespace demo istio.io/dataplane-mode=ambient: the running pods are enrolled")
	if err := s.label(ctx, ambient.DataplaneModeAmbient); err != nil {
		return err
	}
	for _, name := range []string{"app-1", "app-2", "app-3"} {
		s.checkCaptured(ctx, name)
	}
	s.capturedRing(ctx)
	return nil
}

func (s *Story) stepNewPod(ctx context.Context) error {
	s.begin("3. a new pod starts: captured before its first packet; kubelet probes pass, SNATed, not through the stand-in")
	hello := appURL(s.pods["app-1"], "/hello-from-app-4")
	p, err := s.startApp(ctx, "app-4", AppOptions{Hello: hello})
	if err != nil {
		return err
	}
	s.say("   app-4 Running and Ready at %s; its first act was GET %s", p.Status.PodIP, hello)
	s.checkCaptured(ctx, "app-4")
	dst := netip.AddrPortFrom(netip.MustParseAddr(s.pods["app-1"].Status.PodIP), AppPort)
	err = s.N.Poll(ctx, "hello record", func(ctx context.Context) (bool, error) {
		recs, err := s.N.StandInRecords(ctx)
		if err != nil {
			return false, err
		}
		for _, r := range recordsOf(recs, p.UID) {
			if r.Port == ambient.ZtunnelOutboundPort && r.OrigDst == dst && r.Err == "" {
				return true, nil
			}
		}
		return false, errors.New("no outbound record of app-4's hello")
	})
	if err == nil {
		var src netip.Addr
		if src, err = seenFrom(ctx, s.pods["app-1"], "/hello-from-app-4"); err == nil && src.String() != s.pods["app-1"].Status.PodIP {
			err = fmt.Errorf("app-1 saw the hello from %s: it bypassed the stand-in", src)
		}
	}
	s.check("app-4's very first connection (at start) went through the stand-in's 15001", err)
	s.checkProbes(ctx, "app-4")
	return nil
}

// checkProbes proves kubelet's probes of a captured pod pass and reach the
// app directly, SNATed to the probe address.
func (s *Story) checkProbes(ctx context.Context, name string) {
	p := s.pods[name]
	snat := ambient.DefaultProbeSNATv4
	var seen []string
	err := s.N.Poll(ctx, "probes of "+name, func(ctx context.Context) (bool, error) {
		var err error
		seen, err = s.N.probedFromSNAT(ctx, p)
		return err == nil, err
	})
	s.check(fmt.Sprintf("%s's readiness and liveness probes reach it from %s (SNAT), sources seen %v", name, snat, seen), err)
	cur, gerr := s.N.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
	if gerr == nil {
		ready := false
		for _, c := range cur.Status.Conditions {
			ready = ready || (c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue)
		}
		restarts := int32(0)
		for _, cs := range cur.Status.ContainerStatuses {
			restarts += cs.RestartCount
		}
		if !ready || restarts != 0 {
			gerr = fmt.Errorf("ready=%v restarts=%d", ready, restarts)
		}
	}
	s.check(fmt.Sprintf("%s stays Ready with no restart (probes pass)", name), gerr)
	recs, err := s.N.StandInRecords(ctx)
	if err == nil {
		for _, r := range recordsOf(recs, p.UID) {
			if r.Port == ambient.ZtunnelInboundPlaintextPort && r.OrigDst.Port() == AppPort && !s.isPodIP(r.Source.Addr()) {
				err = fmt.Errorf("the stand-in's inbound port got a connection from %s (a probe?)", r.Source)
				break
			}
		}
	}
	s.check(fmt.Sprintf("no probe of %s went through the stand-in", name), err)
}

// probedFromSNAT is nil when kubelet's readiness and liveness probes
// reached a pod in the last minute directly, SNATed to the probe address;
// seen are the probe sources in the pod's log.
func (n *Node) probedFromSNAT(ctx context.Context, p *corev1.Pod) (seen []string, err error) {
	snat := ambient.DefaultProbeSNATv4
	entries, err := appLog(ctx, p)
	if err != nil {
		// The host reaches a captured pod through the probe SNAT too:
		// say what became of it.
		return nil, fmt.Errorf("%w; %s", err, n.probeSetReport(p.Status.PodIP))
	}
	ready, live := false, false
	for _, e := range entries {
		if e.Path != "/ready" && e.Path != "/live" {
			continue
		}
		ap, err := netip.ParseAddrPort(e.Remote)
		if err != nil {
			return seen, err
		}
		if !slices.Contains(seen, ap.Addr().String()) {
			seen = append(seen, ap.Addr().String())
		}
		if e.Time.Before(time.Now().Add(-time.Minute)) || ap.Addr() != snat {
			continue
		}
		ready = ready || e.Path == "/ready"
		live = live || e.Path == "/live"
	}
	if !ready || !live {
		err := fmt.Errorf("readiness from %s: %v, liveness from %s: %v (probe sources seen %v)", snat, ready, snat, live, seen)
		return seen, fmt.Errorf("%w; %s", err, n.probeSetReport(p.Status.PodIP))
	}
	return seen, nil
}

func (s *Story) isPodIP(a netip.Addr) bool {
	for _, p := range s.pods {
		if p.Status.PodIP == a.String() {
			return true
		}
	}
	return false
}

func (s *Story) stepOptOut(ctx context.Context) error {
	s.begin("4. a pod labelled istio.io/dataplane-mode=none stays out")
	p, err := s.startApp(ctx, "app-5", AppOptions{Labels: map[string]string{ambient.DataplaneModeLabel: ambient.DataplaneModeNone}})
	if err != nil {
		return err
	}
	s.say("   app-5 Running and Ready at %s", p.Status.PodIP)
	s.checkReleased(ctx, "app-5", "stays out")
	marker, err := s.request(ctx, "app-5", "app-1")
	if s.check("app-5 → app-1 answered", err) {
		recs, err := s.N.StandInRecords(ctx)
		if err == nil && len(recordsOf(recs, p.UID)) > 0 {
			err = fmt.Errorf("the stand-in proxied app-5's connections: %+v", recordsOf(recs, p.UID))
		}
		s.check("app-5's own traffic was not captured", err)
		if src, err := seenFrom(ctx, s.pods["app-1"], marker); err == nil {
			s.say("   (app-1 is enrolled, so its inbound side went through the stand-in: app-1 saw %s)", src)
		}
	}
	return nil
}

func (s *Story) stepUnlabel(ctx context.Context) error {
	s.begin("5. remove the label: everything is undone")
	if err := s.label(ctx, ""); err != nil {
		return err
	}
	for _, name := range []string{"app-1", "app-2", "app-3", "app-4"} {
		s.checkReleased(ctx, name, "released")
	}
	err := s.N.Poll(ctx, "agent state empty", func(ctx context.Context) (bool, error) {
		pods, err := s.N.AgentState(ctx)
		if err != nil {
			return false, err
		}
		if len(pods) > 0 {
			return false, fmt.Errorf("the agent still holds %d pods", len(pods))
		}
		return true, nil
	})
	s.check("the agent holds no pod (/debug/pods is empty)", err)
	err = s.N.Poll(ctx, "probe set empty", func(ctx context.Context) (bool, error) {
		ips, _, err := hostProbeSet()
		if err == nil && len(ips) > 0 {
			err = fmt.Errorf("host probe set still holds %v", ips)
		}
		return err == nil, err
	})
	s.check("the host probe set is empty", err)
	s.directRing(ctx)
	return nil
}

// probeSetReport says whether the host probe set holds ip, and names other
// node agents running on this machine outside this node: on a shared
// machine one in the host network namespace (a sandbox, a test) manages
// the same host probe set and may drop this node's addresses from it.
func (n *Node) probeSetReport(ip string) string {
	members, exists, err := hostProbeSet()
	var b strings.Builder
	switch {
	case err != nil:
		fmt.Fprintf(&b, "host probe set: %v", err)
	case !exists:
		fmt.Fprintf(&b, "the host probe set %s is gone", ruleset.ProbeSetV4)
	default:
		fmt.Fprintf(&b, "host probe set %s holds %s: %v", ruleset.ProbeSetV4, ip, slices.Contains(members, ip))
	}
	if others := n.foreignAgents(); len(others) > 0 {
		fmt.Fprintf(&b, "; other agents on this machine: %s", strings.Join(others, "; "))
	}
	return b.String()
}

// foreignAgents lists install-cni processes in the host network namespace
// that are not pods of this node (whose kubelet owns the kubepods cgroup:
// one real node per machine).
func (n *Node) foreignAgents() []string {
	host, _ := os.Readlink("/proc/self/ns/net")
	var out []string
	pids, _ := os.ReadDir("/proc")
	for _, de := range pids {
		if _, err := strconv.Atoi(de.Name()); err != nil {
			continue
		}
		dir := "/proc/" + de.Name()
		comm, err := os.ReadFile(dir + "/comm")
		if err != nil || strings.TrimSpace(string(comm)) != "install-cni" {
			continue
		}
		if ns, _ := os.Readlink(dir + "/ns/net"); ns != host {
			continue
		}
		if cg, _ := os.ReadFile(dir + "/cgroup"); bytes.Contains(cg, []byte("/kubepods/")) {
			continue
		}
		cmd, _ := os.ReadFile(dir + "/cmdline")
		out = append(out, de.Name()+" "+strings.TrimSpace(string(bytes.ReplaceAll(cmd, []byte{0}, []byte{' '}))))
	}
	return out
}

// hostProbeSet lists the members of the agent's host probe set for IPv4:
// an nftables set in the agent's host table (nftables backend) or an
// ipset (iptables backends).
func hostProbeSet() (members []string, exists bool, err error) {
	out, err := runOut("nft", "list", "set", "inet", nftables.TableHost, ruleset.ProbeSetV4)
	if err == nil {
		_, m, _ := strings.Cut(out, "elements = {")
		m, _, _ = strings.Cut(m, "}")
		return strings.Fields(strings.ReplaceAll(m, ",", " ")), true, nil
	}
	out, err = runOut("ipset", "list", ruleset.ProbeSetV4)
	if err != nil {
		if strings.Contains(out, "does not exist") {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("ipset list: %w: %s", err, out)
	}
	_, m, _ := strings.Cut(out, "Members:")
	return strings.Fields(m), true, nil
}

// Table prints the pods, their addresses, their capture state and how
// many connections the stand-in proxied for each.
func (s *Story) Table(ctx context.Context, w io.Writer) error {
	recs, err := s.N.StandInRecords(ctx)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 8, 2, ' ', 0)
	header := "POD\tIP\tSTATE\tCAPTURED CONNECTIONS"
	if s.Istiod != nil {
		header += "\tISTIOD"
	}
	fmt.Fprintln(tw, header)
	for _, name := range s.order {
		p := s.pods[name]
		cur, err := s.N.Client.CoreV1().Pods(p.Namespace).Get(ctx, p.Name, metav1.GetOptions{})
		state := "gone"
		if err == nil {
			state = "not captured"
			if v, ok := cur.Annotations[ambient.RedirectionAnnotation]; ok {
				state = "captured (" + v + ")"
			}
			if cur.Labels[ambient.DataplaneModeLabel] == ambient.DataplaneModeNone {
				state += ", opted out"
			}
		}
		row := fmt.Sprintf("%s/%s\t%s\t%s\t%d", p.Namespace, p.Name, p.Status.PodIP, state, len(recordsOf(recs, p.UID)))
		if s.Istiod != nil {
			row += "\t" + s.Istiod.ViewOf(ctx, p.Namespace, p.Name)
		}
		fmt.Fprintln(tw, row)
	}
	return tw.Flush()
}

func runOut(name string, args ...string) (string, error) {
	out, err := execCommand(name, args...).CombinedOutput()
	return string(out), err
}

// DemoOption changes what Demo does.
type DemoOption func(*demoConfig)

type demoConfig struct{ skipStory bool }

// SkipStory only brings the node up with the agent and the stand-in.
func SkipStory() DemoOption { return func(c *demoConfig) { c.skipStory = true } }

// Demo brings a node up, installs ambient-cni with helm, the ztunnel
// stand-in and istiod, plays the story, prints the table (with istiod's
// view of each pod) and tears the node down.
// With keep it stays up until ctx ends. It fails if any proof failed.
func Demo(ctx context.Context, out io.Writer, keep bool, opts ...DemoOption) (err error) {
	var cfg demoConfig
	for _, o := range opts {
		o(&cfg)
	}
	fmt.Fprintln(out, "== a real node: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, containerd, kubelet")
	n, err := Up(ctx, Options{Out: out})
	if err != nil {
		return err
	}
	defer func() {
		if derr := n.Down(); derr != nil {
			err = errors.Join(err, derr)
		}
	}()
	fmt.Fprintf(out, "\n== helm install %s %s@sha256:… --plain-http, verified first as docs/release.md says (the node's own key; image %s, pulled by containerd from the loopback registry)\n", Release, n.ChartRef(), n.AgentImage(ImageTag))
	start := time.Now()
	if err := n.InstallAgent(ctx, "install", ImageTag); err != nil {
		return err
	}
	agents, err := n.AgentPods(ctx)
	if err != nil || len(agents) != 1 {
		return fmt.Errorf("want one agent pod, got %d (%v)", len(agents), err)
	}
	fmt.Fprintf(out, "   DaemonSet pod %s Ready in %v; the plugin is chained into %s\n", agents[0].Name, time.Since(start).Round(100*time.Millisecond), n.CNIConfFile)
	fmt.Fprintln(out, "== the ztunnel stand-in as a pod (host network, /var/run/ztunnel)")
	if err := n.StartStandIn(ctx); err != nil {
		return err
	}
	fmt.Fprintln(out, "== istiod, as its chart runs it for ambient (host process, loopback only)")
	ist, err := n.StartIstiod(ctx, IstiodOptions{})
	if err != nil {
		return err
	}
	defer func() { _ = ist.Stop() }() // before the node goes down
	s := &Story{N: n, Out: out, Istiod: ist}
	if !cfg.skipStory {
		runErr := s.Run(ctx)
		s.begin("nothing left the machine")
		hits, gerr := n.GuardHits()
		if gerr == nil && len(hits) > 0 {
			gerr = fmt.Errorf("the egress guard counted %v", hits)
		}
		s.check("no connection to an address off this machine was attempted (nftables egress guard)", gerr)
		fmt.Fprintln(out)
		if terr := s.Table(ctx, out); terr != nil {
			fmt.Fprintln(out, "table:", terr)
		}
		failed := s.Failed()
		fmt.Fprintf(out, "\n%d proofs checked, %d failed\n", len(s.Proofs), len(failed))
		if runErr != nil || len(failed) > 0 {
			err = fmt.Errorf("the demo failed: %d of %d proofs", len(failed), len(s.Proofs))
			if runErr != nil {
				err = fmt.Errorf("%w; stopped at: %v", err, runErr)
			}
		}
	}
	if keep && ctx.Err() == nil {
		n.explain(out)
		fmt.Fprintf(out, "   istiod's view: curl -s '127.0.0.1:%d/debug/ambientz?pretty'; its log: %s\n", ist.HTTPPort, filepath.Join(ist.Dir, "istiod.log"))
		<-ctx.Done()
		fmt.Fprintln(out)
	}
	return err
}

// explain prints how to explore a kept node.
func (n *Node) explain(out io.Writer) {
	agent := "<agent pod>"
	if pods, err := n.AgentPods(context.Background()); err == nil && len(pods) > 0 {
		agent = pods[0].Name
	}
	netns := "<netns of a pod>"
	if p, err := n.PodNetns(context.Background(), DemoNamespace, "app-1"); err == nil {
		netns = p
	}
	ep := "unix://" + n.ContainerdSocket
	fmt.Fprintf(out, `
== the node stays up; explore it as root in another shell:
   export KUBECONFIG=%s      # admin credentials, for kubectl or helm
   kubectl get pods -A -o wide; kubectl -n %s logs %s
   %s --runtime-endpoint %s pods            # containerd's view
   nsenter --net=%s nft list ruleset         # a pod's capture rules (like ip netns exec; iptables-save with an iptables backend)
   curl -s --unix-socket %s http://agent/debug/pods   # the agent's enrolled pods
   curl -s --unix-socket %s 'http://agent/debug/explain?pod=demo/app-1'   # why a pod is (not) captured
   curl -s 127.0.0.1:%d/metrics
   curl -s 127.0.0.1:%d/records                # the ztunnel stand-in's connection log
   cat %s                                     # the chained CNI config
   ls %s                                      # logs of every component
== Ctrl-C here tears the node down and leaves the host as it was
   (if this process is killed instead: make demo-down)
`, n.Kubeconfig, ReleaseNamespace, agent, n.Tools.Crictl, ep, netns, n.AgentDebugSocket(), n.AgentDebugSocket(), AgentMetricsPort, n.standInPort, n.CNIConfFile, n.Dir)
}
