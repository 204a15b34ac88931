package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestForgetLeavesStateBeforeZtunnelDel: when ztunnel is told
// to drop a pod, the pod is already out of the state the ZDS snapshot is
// built from, on every way out (CNI DEL, unenroll), so a ztunnel that
// connects in between never gets an Add for a removed pod.
func TestForgetLeavesStateBeforeZtunnelDel(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	var mu sync.Mutex
	var inSnapshot []string
	h.zt.onDel = func(uid string) {
		for _, w := range h.agent.Workloads() {
			if w.UID == uid {
				mu.Lock()
				inSnapshot = append(inSnapshot, uid)
				mu.Unlock()
			}
		}
	}
	h.kube.SetPod(pod("shop", "a", "u-a", nil))
	h.kube.SetPod(pod("shop", "b", "u-b", nil))
	if _, err := h.add(ctx, info("shop/a", "u-a", "sb-a"), testnet.NewNS(t)); err != nil {
		t.Fatal(err)
	}
	if err := h.agent.Capture(ctx, pod("shop", "b", "u-b", nil), openNS(t, testnet.NewNS(t)), nil); err != nil {
		t.Fatal(err)
	}
	if err := h.agent.RemoveSandbox(ctx, SandboxDel{SandboxID: "sb-a", UID: "u-a"}); err != nil {
		t.Fatal(err)
	}
	if err := h.agent.Unenroll(ctx, "u-b"); err != nil {
		t.Fatal(err)
	}
	if got := h.zt.delLog(); got != "u-a,u-b" {
		t.Fatalf("ztunnel dels %q", got)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(inSnapshot) != 0 {
		t.Errorf("ztunnel Del sent while the snapshot source still named %v", inSnapshot)
	}
}

// TestUnenrollOrder: rules first (a failure keeps the pod
// fully captured and retried), then ztunnel, then the annotation, and the
// capture record only once the annotation is written. An annotation that
// cannot be written keeps the record, so a crash then leaves the pod to
// the next agent, which finishes the job.
func TestUnenrollOrder(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	pn := testnet.NewNS(t)
	p := pod("shop", "web", "u1", nil)
	h.kube.SetPod(p)
	if err := h.agent.Capture(ctx, p, openNS(t, pn), nil); err != nil {
		t.Fatal(err)
	}
	h.annotations(t, "u1")

	// The rules cannot be removed: nothing else changes, retryable.
	h.rules.mu.Lock()
	h.rules.removeErr = errors.New("netlink: busy")
	h.rules.mu.Unlock()
	if err := h.agent.Unenroll(ctx, "u1"); !IsRetryable(err) {
		t.Fatalf("unenroll with failing rule removal: %v, want retryable", err)
	}
	if len(h.agent.Pods()) != 1 || h.zt.delLog() != "" || h.rules.count() != 1 || h.annotations(t, "u1") != "enabled" {
		t.Fatalf("a failed rule removal changed the pod: state %v, dels %q, rules %d, annotations %q",
			h.agent.Pods(), h.zt.delLog(), h.rules.count(), h.ann.history("u1"))
	}
	h.rules.mu.Lock()
	h.rules.removeErr = nil
	h.rules.mu.Unlock()

	// The API refuses the annotation write: the record stays.
	h.ann.setErr(apierrors.NewServiceUnavailable("API server down"))
	if err := h.agent.Unenroll(ctx, "u1"); err != nil {
		t.Fatal(err)
	}
	if h.rules.count() != 0 || h.zt.delLog() != "u1" || len(h.agent.Pods()) != 0 {
		t.Fatalf("after unenroll: rules %d, dels %q, state %v", h.rules.count(), h.zt.delLog(), h.agent.Pods())
	}
	poll.Until(t, "the annotation write retried", func() bool { return h.ann.attempts("u1") >= 2 })
	if got := h.recorded(t); !slices.Equal(got, []string{"u1"}) {
		t.Fatalf("capture records %v while the annotation is not cleared; want the pod's kept", got)
	}
	if uid, ok := h.agent.EnrolledUID("shop", "web"); !ok || uid != "u1" {
		t.Errorf("a pod with a record left is not free of the agent yet: EnrolledUID = %q, %v", uid, ok)
	}

	// A crash now: the next agent finds the record and finishes.
	h.restart(t)
	h.ann.setErr(nil)
	if got := h.agent.Records(); len(got) != 1 || got[0].UID != "u1" {
		t.Fatalf("records after the restart: %+v", got)
	}
	if err := h.agent.Unenroll(ctx, "u1"); err != nil {
		t.Fatal(err)
	}
	if got := h.annotations(t, "u1"); got != "enabled," {
		t.Errorf("annotations %q, want the removal written", got)
	}
	if got := h.recorded(t); len(got) != 0 {
		t.Errorf("capture records left: %v", got)
	}
}

// TestPendingConvergesOnSnapshotAck: a pod whose ztunnel
// handoff failed stays captured and pending; once a ztunnel acks it in a
// snapshot it is enabled and annotated so, with no ADD retry. An ack for
// another namespace than the one held does not count.
func TestPendingConvergesOnSnapshotAck(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	h.zt.setAddErr(errors.New("no ztunnel connected"))
	if _, err := h.add(ctx, info("shop/web", "u1", "sb1"), testnet.NewNS(t)); !IsRetryable(err) {
		t.Fatalf("ADD without ztunnel: %v", err)
	}
	if got := h.annotations(t, "u1"); got != "pending" {
		t.Fatalf("annotations %q", got)
	}
	ws := h.agent.Workloads()
	if len(ws) != 1 {
		t.Fatalf("snapshot %+v", ws)
	}
	other, err := os.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	h.agent.SnapshotAcked("u1", other)
	if !h.agent.Pending("u1") {
		t.Fatal("an ack for another namespace enabled the pod")
	}
	h.agent.SnapshotAcked(ws[0].UID, ws[0].Netns)
	if h.agent.Pending("u1") {
		t.Fatal("still pending after the snapshot ack")
	}
	if got := h.annotations(t, "u1"); got != "pending,enabled" {
		t.Errorf("annotations %q, want pending then enabled", got)
	}
}

// TestDelOfControllerCapturedPod: a pod the controller
// captured has no sandbox id; a DEL names it by its netns identity. A DEL
// naming another namespace, or one that cannot tell while the pod lives
// on, leaves the enrollment; once the pod is going, an unclear DEL
// releases it. No DEL rewrites rules or writes the annotation.
func TestDelOfControllerCapturedPod(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	pn, older := testnet.NewNS(t), testnet.NewNS(t)
	p := pod("shop", "web", "u1", nil)
	h.kube.SetPod(p)
	if err := h.agent.Capture(ctx, p, openNS(t, pn), nil); err != nil {
		t.Fatal(err)
	}
	if got := h.annotations(t, "u1"); got != "enabled" {
		t.Fatalf("annotations %q", got)
	}
	base := SandboxDel{SandboxID: "sb-unknown", UID: "u1", Namespace: "shop", Name: "web"}
	for _, d := range []SandboxDel{
		withNetns(base, older.Path()),          // an older sandbox's namespace
		withNetns(base, ""),                    // no path, pod lives on
		withNetns(base, "/var/run/netns/gone"), // gone, pod lives on
	} {
		if err := h.agent.RemoveSandbox(ctx, d); err != nil || len(h.agent.Pods()) != 1 {
			t.Fatalf("DEL %+v released the current enrollment (%v)", d, err)
		}
	}
	if err := h.agent.RemoveSandbox(ctx, withNetns(base, pn.Path())); err != nil || len(h.agent.Pods()) != 0 {
		t.Fatalf("DEL naming the held namespace: %v, state %v", err, h.agent.Pods())
	}
	if strings.Contains(h.rules.ops(), "remove") || h.rules.count() != 1 {
		t.Errorf("rule ops %q: DEL must leave the rules to the namespace's destruction", h.rules.ops())
	}
	if got := h.annotations(t, "u1"); got != "enabled" {
		t.Errorf("annotations %q: a DEL must not write the annotation", got)
	}
	// The controller must not capture the torn-down namespace again while
	// a process lingers in it; a new sandbox's namespace is fine.
	if err := h.agent.Capture(ctx, p, openNS(t, pn), nil); !IsRetryable(err) || len(h.agent.Pods()) != 0 {
		t.Fatalf("capture of a torn-down sandbox's netns: %v", err)
	}
	// Another pod whose namespace carries the torn one's identity (the
	// kernel reuses a freed namespace's inode number) is not refused.
	other := pod("shop", "api", "u2", nil)
	h.kube.SetPod(other)
	if err := h.agent.Capture(ctx, other, openNS(t, pn), nil); err != nil {
		t.Fatalf("capture of another pod in a namespace with a torn identity: %v", err)
	}
	if err := h.agent.Unenroll(ctx, "u2"); err != nil {
		t.Fatal(err)
	}
	if err := h.agent.Capture(ctx, p, openNS(t, older), nil); err != nil {
		t.Fatal(err)
	}
	// Terminating: a DEL that cannot tell releases it.
	h.annotations(t, "u1")
	now := metav1.Now()
	cached, err := h.kube.Cache.Pod("shop", "web")
	if err != nil {
		t.Fatal(err)
	}
	p = cached.DeepCopy()
	p.DeletionTimestamp = &now
	h.kube.SetPod(p)
	poll.Until(t, "the cache sees the deletion", func() bool {
		c, err := h.kube.Cache.Pod("shop", "web")
		return err == nil && c.DeletionTimestamp != nil
	})
	if err := h.agent.RemoveSandbox(ctx, withNetns(base, "")); err != nil || len(h.agent.Pods()) != 0 {
		t.Fatalf("unclear DEL of a terminating pod: %v, state %v", err, h.agent.Pods())
	}
}

// TestNewSandboxWithTornIdentityIsCaptured: the kernel hands a freed
// namespace's inode number to the next one, so the same pod's next
// sandbox, started right after the DEL without an ADD to the agent (our
// plugin not chained), can carry the torn namespace's identity. The
// controller's capture of it is refused only while the namespace holds
// nothing but the torn sandbox's IPs.
func TestNewSandboxWithTornIdentityIsCaptured(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	pn := testnet.NewNS(t)
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("nsenter", append([]string{"--net=" + pn.Path(), "ip"}, args...)...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
	}
	ip("link", "set", "lo", "up")
	ip("addr", "add", "10.1.0.5/32", "dev", "lo")
	p := pod("shop", "web", "u1", nil)
	p.Status.PodIPs = []corev1.PodIP{{IP: "10.1.0.5"}}
	h.kube.SetPod(p)
	if err := h.agent.Capture(ctx, p, openNS(t, pn), nil); err != nil {
		t.Fatal(err)
	}
	del := SandboxDel{SandboxID: "sb-unknown", UID: "u1", Namespace: "shop", Name: "web", Netns: pn.Path()}
	if err := h.agent.RemoveSandbox(ctx, del); err != nil || len(h.agent.Pods()) != 0 {
		t.Fatalf("DEL: %v, state %v", err, h.agent.Pods())
	}
	if err := h.agent.Capture(ctx, p, openNS(t, pn), nil); !IsRetryable(err) {
		t.Fatalf("capture of the torn sandbox's namespace (only its IPs): %v", err)
	}
	// The new sandbox got another address.
	ip("addr", "del", "10.1.0.5/32", "dev", "lo")
	ip("addr", "add", "10.1.0.6/32", "dev", "lo")
	p = p.DeepCopy()
	p.Status.PodIPs = []corev1.PodIP{{IP: "10.1.0.6"}}
	h.kube.SetPod(p)
	if err := h.agent.Capture(ctx, p, openNS(t, pn), nil); err != nil || len(h.agent.Pods()) != 1 {
		t.Fatalf("capture of the new sandbox in a namespace with the torn identity: %v, state %v", err, h.agent.Pods())
	}
}

func withNetns(d SandboxDel, path string) SandboxDel {
	d.Netns = path
	return d
}

// TestReplayedDelCleansUnrestoredPod: a DEL replayed from the
// spool for a pod the agent does not hold (it was not restored) removes
// our rules from its namespace when that still exists, and its record;
// it never touches the namespace of a pod the agent holds.
func TestReplayedDelCleansUnrestoredPod(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	spool := h.layout().DelSpool()
	gone, held := testnet.NewNS(t), testnet.NewNS(t)
	// A previous agent captured "gone"; no record (an older agent).
	if err := h.rules.seed(gone.Path(), ruleset.PodConfig{}); err != nil {
		t.Fatal(err)
	}
	// "held" is captured by this agent; a stale spool entry names it.
	h.kube.SetPod(pod("shop", "held", "u-held", nil))
	if _, err := h.add(ctx, info("shop/held", "u-held", "sb-held"), held); err != nil {
		t.Fatal(err)
	}
	for _, ev := range []ambient.PodEvent{
		{Command: ambient.CommandDel, SandboxID: "sb-gone", PodUID: "u-gone", PodNamespace: "shop", PodName: "gone", Netns: gone.Path()},
		{Command: ambient.CommandDel, SandboxID: "sb-stale", PodUID: "u-other", PodNamespace: "shop", PodName: "other", Netns: held.Path()},
	} {
		if err := nodefiles.Spool(spool, ev); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := h.agent.DrainSpool(ctx); err != nil || n != 2 {
		t.Fatalf("DrainSpool = %d, %v", n, err)
	}
	if h.rules.populated(gone.Path()) {
		t.Error("the replayed DEL left our rules in the namespace of a pod the agent did not hold")
	}
	if !h.rules.populated(held.Path()) || len(h.agent.Pods()) != 1 {
		t.Error("a replayed DEL naming an enrolled pod's namespace removed its capture")
	}
}

// TestRecordsAcrossRestart: the record is written before the
// rules and outlives a crash that lost the annotation write; the next
// agent restores the pod from the record (pending, no annotation yet),
// and a snapshot ack gets it annotated enabled.
func TestRecordsAcrossRestart(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	pn := testnet.NewNS(t)
	p := pod("shop", "web", "u1", nil)
	h.kube.SetPod(p)
	h.ann.setErr(apierrors.NewTimeoutError("slow API", 1))
	if _, err := h.add(ctx, info("shop/web", "u1", "sb1"), pn); err != nil {
		t.Fatal(err)
	}
	h.restart(t) // the queued annotation write is lost
	h.ann.setErr(nil)
	recs := h.agent.Records()
	if len(recs) != 1 || recs[0].UID != "u1" || recs[0].SandboxID != "sb1" || recs[0].Netns != pn.Path() ||
		!slices.Equal(recs[0].IPs, []netip.Addr{netip.MustParseAddr("10.9.0.5")}) {
		t.Fatalf("records after restart: %+v", recs)
	}
	if err := h.agent.Restore(ctx, p, openNS(t, pn)); err != nil {
		t.Fatal(err)
	}
	ps := h.agent.Pods()
	if len(ps) != 1 || ps[0].State != StatePending || ps[0].SandboxID != "sb1" {
		t.Fatalf("restored %+v, want pending with the recorded sandbox", ps)
	}
	ws := h.agent.Workloads()
	h.agent.SnapshotAcked(ws[0].UID, ws[0].Netns)
	if got := h.annotations(t, "u1"); got != "enabled" {
		t.Errorf("annotations %q, want enabled written once", got)
	}
	// The recorded sandbox id lets its DEL find the restored pod.
	if err := h.agent.RemoveSandbox(ctx, SandboxDel{SandboxID: "sb1"}); err != nil || len(h.agent.Pods()) != 0 {
		t.Fatalf("DEL of the recorded sandbox: %v, %v", err, h.agent.Pods())
	}
	if got := h.recorded(t); len(got) != 0 {
		t.Errorf("records left: %v", got)
	}
}

// TestAnnotationWriter: only the latest value is written (coalesced),
// failures are retried with backoff, a pod that is gone drops its write
// and runs what waited for it, and a value the pod already carries (pod
// cache) is not written again.
func TestAnnotationWriter(t *testing.T) {
	h := newHarness(t)
	w := h.agent.annotations
	// Coalescing: the annotator is held while three values are wanted.
	h.ann.hold()
	w.set("shop", "a", "u-a", "pending", nil)
	poll.Until(t, "the first write in flight", func() bool { return h.ann.attempts("u-a") == 1 })
	w.set("shop", "a", "u-a", "enabled", nil)
	w.set("shop", "a", "u-a", "", nil)
	w.set("shop", "a", "u-a", "enabled", nil)
	h.ann.release()
	if got := h.annotations(t, "u-a"); got != "pending,enabled" {
		t.Errorf("writes %q, want the in-flight one and the latest", got)
	}
	// Retries.
	h.ann.setErr(errors.New("connection refused"))
	w.set("shop", "b", "u-b", "enabled", nil)
	poll.Until(t, "retries", func() bool { return h.ann.attempts("u-b") >= 3 })
	h.ann.setErr(nil)
	if got := h.annotations(t, "u-b"); got != "enabled" {
		t.Errorf("writes %q after retries", got)
	}
	// Gone: NotFound (the Annotator's answer for a pod replaced under its
	// name too, see TestUnenrollRecreatedPod).
	h.ann.setErr(apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, "c"))
	ran := make(chan struct{})
	w.set("shop", "c", "u-gone", "", func() { close(ran) })
	select {
	case <-ran:
	case <-time.After(30 * time.Second):
		t.Fatal("NotFound: the write was not dropped")
	}
	if n := h.ann.attempts("u-gone"); n != 1 {
		t.Errorf("NotFound: %d attempts, want 1", n)
	}
	// A conflict is not a pod gone: retried until it goes through.
	h.ann.setErr(apierrors.NewConflict(schema.GroupResource{Resource: "pods"}, "c", errors.New("the object has been modified")))
	w.set("shop", "c", "u-busy", "enabled", nil)
	poll.Until(t, "a conflict retried", func() bool { return h.ann.attempts("u-busy") >= 2 })
	h.ann.setErr(nil)
	if got := h.annotations(t, "u-busy"); got != "enabled" {
		t.Errorf("writes %q after conflicts, want enabled", got)
	}
	// Already on the object (as the pod cache shows): not written.
	d := pod("shop", "d", "u-d", nil)
	d.Annotations = map[string]string{ambient.RedirectionAnnotation: ambient.RedirectionEnabled}
	h.kube.SetPod(d)
	poll.Until(t, "the cache has d", func() bool { _, err := h.kube.Cache.Pod("shop", "d"); return err == nil })
	w.set("shop", "d", "u-d", "enabled", nil)
	if got := h.annotations(t, "u-d"); got != "" {
		t.Errorf("writes %q for a value the pod carries", got)
	}
}

// TestRecordFiles: records survive a reload; unusable files in the record
// directory are removed and reported, never followed or trusted.
func TestRecordFiles(t *testing.T) {
	dir := t.TempDir()
	s := newRecordStore(nodefiles.InDir(dir).Records(), newLifeTable())
	good := Record{UID: "0b2e6c1e-1d6b-4c1e-9a52-4b8a0c4b0f11", Namespace: "shop", Name: "web", SandboxID: "sb",
		Netns: "/var/run/netns/cni-1", NetnsDev: 4, NetnsIno: 4026532000, IPs: []netip.Addr{netip.MustParseAddr("10.0.0.1")}}
	if err := s.write(good); err != nil {
		t.Fatal(err)
	}
	if err := s.write(Record{UID: "../escape", Namespace: "x", Name: "y"}); err == nil {
		t.Error("a uid that escapes the directory was written")
	}
	if st, err := os.Stat(s.dir); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("record dir mode: %v, %v", st, err)
	}
	if st, err := os.Stat(s.path(good.UID)); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("record mode: %v, %v", st, err)
	}
	outside := filepath.Join(dir, "secret.json")
	if err := os.WriteFile(outside, []byte(`{}`), 0o600); err != nil {
		t.Fatal(err)
	}
	bad := map[string]func(p string) error{
		"link.json": func(p string) error { return os.Symlink(outside, p) },
		"dir.json":  func(p string) error { return os.Mkdir(p, 0o700) },
		"big.json":  func(p string) error { return os.WriteFile(p, make([]byte, maxRecordBytes+1), 0o600) },
		"junk.json": func(p string) error { return os.WriteFile(p, []byte("{not json"), 0o600) },
		"other.json": func(p string) error {
			return os.WriteFile(p, []byte(`{"uid":"u-x","namespace":"a","name":"b"}`), 0o600)
		},
		"extra.json": func(p string) error {
			return os.WriteFile(p, []byte(`{"uid":"extra","namespace":"a","name":"b","evil":1}`), 0o600)
		},
		".ambient-cni-123.tmp": func(p string) error { return os.WriteFile(p, []byte("half"), 0o600) },
	}
	for name, mk := range bad {
		if err := mk(filepath.Join(s.dir, name)); err != nil {
			t.Fatal(err)
		}
	}
	s2 := newRecordStore(s.dir, newLifeTable())
	err := s2.load()
	if err == nil || !strings.Contains(err.Error(), "junk.json") {
		t.Errorf("load reported %v, want the unusable files named", err)
	}
	if got := s2.all(); len(got) != 1 || !sameRecord(got[0], good) {
		t.Errorf("loaded %+v, want only the good record", got)
	}
	des, _ := os.ReadDir(s.dir)
	if len(des) != 1 {
		var names []string
		for _, de := range des {
			names = append(names, de.Name())
		}
		t.Errorf("files left in the record dir: %v", names)
	}
	if _, err := os.Stat(outside); err != nil {
		t.Errorf("the symlink's target was touched: %v", err)
	}
	if err := s2.removeIf(good.UID, 99); err != nil {
		t.Fatal(err)
	}
	if _, ok := s2.get(good.UID); !ok {
		t.Error("removeIf with a stale generation removed the record")
	}
}

// FuzzParseRecord: no input makes the record parser panic, and whatever
// it accepts is a record that can name its file.
func FuzzParseRecord(f *testing.F) {
	fuzzseed.Add(f, "FuzzParseRecord")
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := parseRecord(b)
		if err != nil {
			return
		}
		if !validRecordUID(r.UID) || r.Namespace == "" || r.Name == "" {
			t.Fatalf("accepted %+v", r)
		}
	})
}

// TestGCDropsRecordOnlyPods: a pod known only by its capture record (a
// restart did not restore it) whose sandbox the runtime no longer has is
// dropped by GC: its record goes; a record whose sandbox is valid stays.
func TestGCDropsRecordOnlyPods(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	for _, n := range []string{"a", "b"} {
		h.kube.SetPod(pod("shop", n, "u-"+n, nil))
		if _, err := h.add(ctx, info("shop/"+n, "u-"+n, "sb-"+n), testnet.NewNS(t)); err != nil {
			t.Fatal(err)
		}
	}
	h.restart(t) // nothing restored: both known only by their records
	if got := h.recorded(t); len(got) != 2 {
		t.Fatalf("records after restart: %v", got)
	}
	if n := h.agent.GC(ctx, "", []string{"sb-b"}); n != 1 {
		t.Errorf("GC removed %d, want 1", n)
	}
	if got := h.recorded(t); len(got) != 1 || !strings.Contains(got[0], "u-b") {
		t.Errorf("records after GC: %v, want only u-b's", got)
	}
}

// TestUnenrollOfDeletedPodWritesNothing: unenrolling a pod
// that is being deleted, or already gone, removes its rules, its ztunnel
// workload and its record, but makes no API request: its annotation goes
// with the object.
func TestUnenrollOfDeletedPodWritesNothing(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	for _, gone := range []bool{false, true} {
		uid := types.UID(fmt.Sprintf("u-%v", gone))
		p := pod("shop", "web", string(uid), nil)
		h.kube.SetPod(p)
		if err := h.agent.Capture(ctx, p, openNS(t, testnet.NewNS(t)), nil); err != nil {
			t.Fatal(err)
		}
		if got := h.annotations(t, uid); got != "enabled" {
			t.Fatalf("annotations %q", got)
		}
		if gone {
			h.kube.DeletePod("shop", "web")
			poll.Until(t, "the cache sees the pod gone", func() bool {
				_, err := h.kube.Cache.Pod("shop", "web")
				return apierrors.IsNotFound(err)
			})
		} else {
			now := metav1.Now()
			d := p.DeepCopy()
			d.DeletionTimestamp = &now
			h.kube.SetPod(d)
			poll.Until(t, "the cache sees the deletion", func() bool {
				c, err := h.kube.Cache.Pod("shop", "web")
				return err == nil && c.DeletionTimestamp != nil
			})
		}
		if err := h.agent.Unenroll(ctx, uid); err != nil {
			t.Fatal(err)
		}
		if len(h.agent.Pods()) != 0 || h.rules.count() != 0 {
			t.Fatalf("gone=%v: state %v, %d pods with rules", gone, h.agent.Pods(), h.rules.count())
		}
		if err := h.agent.FlushAnnotations(ctx); err != nil {
			t.Fatal(err)
		}
		if got := h.ann.history(uid); got != "enabled" {
			t.Errorf("gone=%v: annotation writes %q; want none after enabled", gone, got)
		}
		if got := h.recorded(t); len(got) != 0 {
			t.Errorf("gone=%v: records left %v", gone, got)
		}
	}
}
