package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os/exec"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	cnitypes "github.com/containernetworking/cni/pkg/types"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/iptables"
	"github.com/ambient-cni/ambient-cni/pkg/netfilter"
	"github.com/ambient-cni/ambient-cni/pkg/nftables"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
)

// The checks every scenario ends with. Each is a sub-test of its own, so a
// failure names the promise it breaks.
const (
	checkCapturedRules      = "captured pod has its rules"
	checkCapturedZtunnel    = "captured pod is served by ztunnel in its own netns"
	checkCapturedAnnotation = "captured pod is annotated enabled"
	checkCapturedProbe      = "captured pod's IP is in the probe set"
	checkOtherRules         = "uncaptured pod has no rules"
	checkOtherZtunnel       = "uncaptured pod is not served by ztunnel"
	checkOtherAnnotation    = "uncaptured pod has no annotation"
	checkOtherProbe         = "uncaptured pod's IP is not in the probe set"
	checkGoneZtunnel        = "ztunnel serves no pod that is not running"
	checkStrayProbe         = "probe set holds no IP but captured pods'"
	checkHeldNetns          = "agent holds one netns per captured pod"
	checkSpool              = "no spooled DEL is left"
	checkAddCaptured        = "ADD success means captured at return"
	checkDelSucceeds        = "DEL never fails"
)

// checkOrder is the order checks are reported in.
var checkOrder = []string{
	checkCapturedRules, checkCapturedZtunnel, checkCapturedAnnotation, checkCapturedProbe,
	checkOtherRules, checkOtherZtunnel, checkOtherAnnotation, checkOtherProbe,
	checkGoneZtunnel, checkStrayProbe, checkHeldNetns, checkSpool, checkAddCaptured, checkDelSucceeds,
}

// pending names, per check, the fix still to be merged that makes it
// pass: such a check is reported as skipped (with what it saw) instead of
// failed. Remove an entry once its fix is merged; a pending check that
// passes says so in the log.
type pending map[string]string

// results are the violations per check.
type results map[string][]string

func (r results) add(check, format string, args ...any) {
	r[check] = append(r[check], fmt.Sprintf(format, args...))
}

// failing lists the checks with violations, excluding those in skip.
func (r results) failing(skip pending) []string {
	var out []string
	for _, c := range checkOrder {
		if len(r[c]) > 0 {
			if _, ok := skip[c]; !ok {
				out = append(out, c)
			}
		}
	}
	return out
}

// world is what the test knows about the node: the pods it runs, the
// labels it set, and what every CNI call answered.
type world struct {
	n *node

	mu      sync.Mutex
	nsLabel map[string]string // namespace -> dataplane-mode label ("" = none)
	running map[types.UID]*kubesim.Pod
	gone    map[types.UID]string // deleted pods: uid -> namespace/name
	// stable is a namespace whose label never changes: ADD results there
	// are checked the moment they return.
	stable string
	// servedAtAdd also requires the stand-in to serve a pod the moment
	// its ADD returned (not when the stand-in itself is being restarted).
	servedAtAdd bool
	// seen are violations found during the run (checkAddCaptured,
	// checkDelSucceeds).
	seen results
	// counts of CNI outcomes
	adds, addRetries, dels int
	addErrs                map[string]int
}

func newWorld(n *node) *world {
	return &world{
		n: n, nsLabel: map[string]string{}, running: map[types.UID]*kubesim.Pod{}, gone: map[types.UID]string{},
		seen: results{}, addErrs: map[string]int{},
	}
}

// namespace creates a namespace with the dataplane-mode label value
// ("" for none) and records it.
func (w *world) namespace(prefix, mode string) string {
	w.n.t.Helper()
	var labels map[string]string
	if mode != "" {
		labels = map[string]string{ambient.DataplaneModeLabel: mode}
	}
	name := w.n.env.CreateNamespace(w.n.t, prefix+"-"+strings.ToLower(w.n.name[len("chaos-"):]), labels).Name
	w.mu.Lock()
	w.nsLabel[name] = mode
	w.mu.Unlock()
	return name
}

// setMode sets a namespace's dataplane-mode label ("" removes it).
func (w *world) setMode(ctx context.Context, ns, mode string) error {
	var v any
	if mode != "" {
		v = mode
	}
	patch, _ := json.Marshal(map[string]any{"metadata": map[string]any{"labels": map[string]any{ambient.DataplaneModeLabel: v}}})
	if _, err := w.n.env.Client.CoreV1().Namespaces().Patch(ctx, ns, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("label namespace %s: %w", ns, err)
	}
	w.mu.Lock()
	w.nsLabel[ns] = mode
	w.mu.Unlock()
	return nil
}

// shouldCapture is the enablement rule for the pods the suite makes
// (compatibility.md): a pod's own label wins, else its namespace's.
func (w *world) shouldCapture(p *corev1.Pod) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	switch p.Labels[ambient.DataplaneModeLabel] {
	case ambient.DataplaneModeAmbient:
		return true
	case "none":
		return false
	}
	return w.nsLabel[p.Namespace] == ambient.DataplaneModeAmbient
}

// podObject is a pod object with an optional dataplane-mode label.
func podObject(ns, name, mode string) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}}
	if mode != "" {
		p.Labels = map[string]string{ambient.DataplaneModeLabel: mode}
	}
	return p
}

// cniCode is the CNI error code of a failed ADD (0 when it is not a CNI
// error).
func cniCode(err error) uint {
	var e *cnitypes.Error
	if errors.As(err, &e) {
		return e.Code
	}
	return 0
}

// run creates the pod and starts it as kubelet does: a sandbox whose CNI
// ADD fails is torn down and tried again, after a short back-off (kubelet's
// is longer; the test would only be slower), until it starts or ctx ends.
// A successful ADD in the stable namespace is checked at once.
func (w *world) run(ctx context.Context, rng *rand.Rand, obj *corev1.Pod) (*kubesim.Pod, error) {
	created, err := w.n.kube.Create(ctx, obj)
	if err != nil {
		return nil, err
	}
	return w.start(ctx, rng, created)
}

// start runs the sandbox of an existing pod object and writes its status
// (see run).
func (w *world) start(ctx context.Context, rng *rand.Rand, obj *corev1.Pod) (*kubesim.Pod, error) {
	p, _, err := w.startSandbox(ctx, rng, obj)
	if err != nil {
		return nil, err
	}
	return p, w.writeStatus(ctx, p)
}

// writeStatus writes the pod's status Running with its IPs, retrying
// while the API server is away (for up to two minutes), as kubelet's
// status manager does.
func (w *world) writeStatus(ctx context.Context, p *kubesim.Pod) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		err := w.n.kube.SetStatus(ctx, p, corev1.PodRunning)
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		if r := apierrors.ReasonForError(err); r != metav1.StatusReasonUnknown && !apierrors.IsServiceUnavailable(err) &&
			!apierrors.IsInternalError(err) && !apierrors.IsTimeout(err) && !apierrors.IsTooManyRequests(err) {
			return err // the API server answered: retrying will not help
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// startSandbox runs the pod's sandbox, retrying failed ADDs until one
// succeeds or ctx ends, without writing its status. It returns the error
// of each failed ADD.
func (w *world) startSandbox(ctx context.Context, rng *rand.Rand, obj *corev1.Pod) (*kubesim.Pod, []error, error) {
	var failed []error
	for {
		p, err := w.n.kube.StartSandbox(ctx, obj)
		if err == nil {
			w.added(p)
			return p, failed, nil
		}
		failed = append(failed, err)
		w.mu.Lock()
		w.addRetries++
		w.addErrs[fmt.Sprintf("CNI code %d", cniCode(err))]++
		w.mu.Unlock()
		select {
		case <-ctx.Done():
			return nil, failed, err
		case <-time.After(time.Duration(100+rng.IntN(400)) * time.Millisecond):
		}
	}
}

// added records a started pod and checks, for the stable namespace, that
// its capture is exactly in place the moment ADD returned.
func (w *world) added(p *kubesim.Pod) {
	w.mu.Lock()
	w.adds++
	w.running[p.Obj.UID] = p
	stable := p.Obj.Namespace == w.stable
	w.mu.Unlock()
	if !stable {
		return
	}
	want := w.shouldCapture(p.Obj)
	rules, err := w.n.hasRules(p.NS.Path())
	served := true
	if w.servedAtAdd {
		_, served = w.n.standIn().Workload(string(p.Obj.UID))
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	switch {
	case err != nil:
		w.seen.add(checkAddCaptured, "%s: read rules: %v", name(p), err)
	case want && (!rules || !served):
		w.seen.add(checkAddCaptured, "%s: ADD succeeded but rules %v, served by ztunnel %v", name(p), rules, served)
	case !want && rules:
		w.seen.add(checkAddCaptured, "%s: opted out, but ADD left rules", name(p))
	}
}

// stop deletes the pod as a user and kubelet do together (graceful
// delete, CNI DEL, object removed). DEL must never fail.
func (w *world) stop(ctx context.Context, p *kubesim.Pod) error {
	err := w.n.kube.Delete(ctx, p)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.dels++
	delete(w.running, p.Obj.UID)
	w.gone[p.Obj.UID] = name(p)
	if err != nil && strings.Contains(err.Error(), "CNI DEL") {
		w.seen.add(checkDelSucceeds, "%s: %v", name(p), err)
		return nil
	}
	return err
}

func name(p *kubesim.Pod) string { return p.Obj.Namespace + "/" + p.Obj.Name }

// runningPods is a copy of the running pods, by name.
func (w *world) runningPods() []*kubesim.Pod {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := make([]*kubesim.Pod, 0, len(w.running))
	for _, p := range w.running {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return name(out[i]) < name(out[j]) })
	return out
}

// summary is one line about what the run did.
func (w *world) summary() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	var errs []string
	for k, v := range w.addErrs {
		errs = append(errs, fmt.Sprintf("%s ×%d", k, v))
	}
	slices.Sort(errs)
	return fmt.Sprintf("%d pods started (%d failed ADDs retried: %s), %d deleted, %d running",
		w.adds, w.addRetries, strings.Join(errs, ", "), w.dels, len(w.running))
}

// hasRules reports whether the netns holds capture rules of either
// backend (native nftables tables, or iptables chains of either flavour).
func (n *node) hasRules(netnsPath string) (bool, error) {
	nft, err := nftables.HasTables(netnsPath, nftables.PodTables)
	if err != nil || nft {
		return nft, err
	}
	ours := []string{iptables.ChainPrerouting, iptables.ChainOutput}
	ipt, err := netfilter.HasChains(netnsPath, ours)
	if err != nil || ipt {
		return ipt, err
	}
	for _, fam := range []ruleset.Family{ruleset.IPv4, ruleset.IPv6} {
		save := iptables.BackendLegacy.SaveCmd(fam)
		if _, err := exec.LookPath(save); err != nil {
			continue
		}
		out, err := exec.Command("nsenter", "--net="+netnsPath, "--", save).Output()
		if err != nil {
			return false, fmt.Errorf("%s in %s: %w", save, netnsPath, err)
		}
		for _, c := range ours {
			if strings.Contains(string(out), ":"+c+" ") {
				return true, nil
			}
		}
	}
	return false, nil
}

// netnsIno is the inode of the pod's network namespace.
func netnsIno(p *kubesim.Pod) uint64 {
	var st unix.Stat_t
	if err := unix.Stat(p.NS.Path(), &st); err != nil {
		return 0
	}
	return st.Ino
}

// verify compares the node with the world: every running pod that should
// be captured is, completely; every other pod and every deleted one
// carries no trace of capture; the agent holds exactly what it needs.
func (w *world) verify(ctx context.Context) results {
	r := results{}
	n := w.n
	pods := w.runningPods()
	annotations := map[types.UID]string{}
	byNS := map[string]bool{}
	for _, p := range pods {
		byNS[p.Obj.Namespace] = true
	}
	for ns := range byNS {
		list, err := n.env.Client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			r.add(checkCapturedAnnotation, "list pods of %s: %v", ns, err)
			continue
		}
		for _, o := range list.Items {
			annotations[o.UID] = o.Annotations[ambient.RedirectionAnnotation]
		}
	}
	probe, err := n.rules.Probe.IPs()
	if err != nil {
		r.add(checkCapturedProbe, "list the probe set: %v", err)
	}
	inProbe := map[netip.Addr]bool{}
	for _, ip := range probe {
		inProbe[ip] = true
	}
	zt := n.standIn()
	wantProbe := map[netip.Addr]bool{}
	captured := 0
	running := map[string]bool{}
	for _, p := range pods {
		uid := string(p.Obj.UID)
		running[uid] = true
		rules, err := n.hasRules(p.NS.Path())
		if err != nil {
			r.add(checkCapturedRules, "%s: read rules: %v", name(p), err)
		}
		wl, served := zt.Workload(uid)
		ann := annotations[p.Obj.UID]
		ip := p.Addr(4)
		if w.shouldCapture(p.Obj) {
			captured++
			wantProbe[ip] = true
			if !rules {
				r.add(checkCapturedRules, "%s: no rules", name(p))
			}
			switch {
			case !served:
				r.add(checkCapturedZtunnel, "%s: not served", name(p))
			case wl.Netns.Ino != netnsIno(p):
				r.add(checkCapturedZtunnel, "%s: served in netns %d, its own is %d", name(p), wl.Netns.Ino, netnsIno(p))
			}
			if ann != ambient.RedirectionEnabled {
				r.add(checkCapturedAnnotation, "%s: annotation %q", name(p), ann)
			}
			if !inProbe[ip] {
				r.add(checkCapturedProbe, "%s: %s not in the probe set", name(p), ip)
			}
			continue
		}
		if rules {
			r.add(checkOtherRules, "%s: has rules (annotation %q, served %v)", name(p), ann, served)
		}
		if served {
			r.add(checkOtherZtunnel, "%s: served", name(p))
		}
		if ann != "" {
			r.add(checkOtherAnnotation, "%s: annotation %q", name(p), ann)
		}
		if inProbe[ip] {
			r.add(checkOtherProbe, "%s: %s in the probe set", name(p), ip)
		}
	}
	w.mu.Lock()
	gone := map[string]string{}
	for uid, nm := range w.gone {
		gone[string(uid)] = nm
	}
	w.mu.Unlock()
	for _, wl := range zt.Workloads() {
		if !running[wl.UID] {
			what := gone[wl.UID]
			if what == "" {
				what = "unknown pod " + wl.UID
			}
			r.add(checkGoneZtunnel, "%s (deleted) is served", what)
		}
	}
	for _, ip := range probe {
		if !wantProbe[ip] {
			r.add(checkStrayProbe, "%s", ip)
		}
	}
	if held, err := n.heldNetns(); err != nil {
		r.add(checkHeldNetns, "%v", err)
	} else if held != captured {
		r.add(checkHeldNetns, "holds %d network namespaces for %d captured pods", held, captured)
	}
	if s := n.spooled(); s > 0 {
		r.add(checkSpool, "%d spooled DELs", s)
	}
	w.mu.Lock()
	for c, v := range w.seen {
		r[c] = append(r[c], v...)
	}
	w.mu.Unlock()
	return r
}

// settle polls verify until every check passes, or every failing check is
// pending and has been failing for a while (its fix is not merged yet), or
// within passes; it returns the last results.
func (w *world) settle(ctx context.Context, within time.Duration, skip pending) results {
	deadline := time.Now().Add(within)
	var onlyPending time.Time
	for {
		r := w.verify(ctx)
		now := time.Now()
		failing := r.failing(nil)
		if len(failing) == 0 || now.After(deadline) {
			return r
		}
		if len(r.failing(skip)) == 0 {
			if onlyPending.IsZero() {
				onlyPending = now
			}
			if now.Sub(onlyPending) > 15*time.Second {
				return r
			}
		} else {
			onlyPending = time.Time{}
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// judge reports every check as a sub-test: passed, failed, or skipped as
// pending with the violations it saw and the fix it waits for.
func judge(t *testing.T, r results, skip pending) {
	t.Helper()
	for _, c := range checkOrder {
		judgeOne(t, c, r[c], skip)
	}
}

// judgeOne reports one check (see judge).
func judgeOne(t *testing.T, check string, v []string, skip pending) {
	t.Helper()
	marker, isPending := skip[check]
	t.Run(check, func(t *testing.T) {
		if len(v) == 0 {
			if isPending {
				t.Logf("passes: its pending marker (%s) can be removed", marker)
			}
			return
		}
		shown := v
		if len(shown) > 15 {
			shown = append(slices.Clone(shown[:15]), fmt.Sprintf("... and %d more", len(v)-15))
		}
		if isPending {
			t.Skipf("PENDING %s: %d violations:\n  %s", marker, len(v), strings.Join(shown, "\n  "))
		}
		t.Errorf("%d violations:\n  %s", len(v), strings.Join(shown, "\n  "))
	})
}

// churn starts and stops pods in slots until d has passed: each slot runs
// one pod after another (ADD retried as kubelet does), each living for a
// random while, and at the end leaves its pod running or deletes it, at
// random. layout gives a slot's namespace and pod label. The randomness
// comes from seed, per slot. wait returns once every slot is done (their
// pods started, so the agent must be running by then), with any errors.
func (w *world) churn(ctx context.Context, seed uint64, slots int, d time.Duration, layout func(slot int) (ns, mode string)) (wait func() []error) {
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, slots)
	for slot := range slots {
		ns, mode := layout(slot)
		srng := rand.New(rand.NewPCG(seed, uint64(slot)+1))
		wg.Go(func() {
			for gen := 1; ; gen++ {
				p, err := w.run(ctx, srng, podObject(ns, fmt.Sprintf("s%02d-%d", slot, gen), mode))
				if err != nil {
					errs <- fmt.Errorf("slot %d: %w", slot, err)
					return
				}
				time.Sleep(500*time.Millisecond + time.Duration(srng.Int64N(int64(3500*time.Millisecond))))
				if time.Since(start) >= d && srng.IntN(2) == 0 {
					return // left running
				}
				if err := w.stop(ctx, p); err != nil {
					errs <- fmt.Errorf("slot %d: %w", slot, err)
					return
				}
				if time.Since(start) >= d {
					return
				}
			}
		})
	}
	return func() []error {
		wg.Wait()
		close(errs)
		var out []error
		for err := range errs {
			out = append(out, err)
		}
		return out
	}
}
