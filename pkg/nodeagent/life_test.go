package nodeagent

import (
	"context"
	"errors"
	"go/ast"
	"go/parser"
	"go/token"
	"go/types"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// allStates and allEvents are every state and event of a pod's life.
var (
	allStates = []lifeState{stateUncaptured, statePending, stateEnabled, stateReleased, stateForgotten}
	allEvents = []lifeEvent{evCapture, evRestore, evAck, evAckTimeout, evUnenroll, evDel, evStop}
)

// requireNoInvalidTransitions fails the test if a refused a state
// transition: every test's pods go only where the diagram goes.
func requireNoInvalidTransitions(t *testing.T, a *Agent) {
	t.Helper()
	if n := a.InvalidTransitions(); n != 0 {
		t.Errorf("the agent refused %d invalid pod state transitions (see the log)", n)
	}
}

type lifeEdge struct {
	from lifeState
	ev   lifeEvent
}

// docsLife parses the pod-state diagram of docs/how-it-works.md: its
// labelled edges by (state, event), and its edges from and to [*].
func docsLife(t *testing.T) (edges map[lifeEdge]lifeState, start, end []string) {
	t.Helper()
	b, err := os.ReadFile("../../docs/how-it-works.md")
	if err != nil {
		t.Fatal(err)
	}
	_, block, ok := strings.Cut(string(b), "```mermaid\nstateDiagram-v2\n")
	if !ok {
		t.Fatal("docs/how-it-works.md has no stateDiagram-v2 block")
	}
	block, _, _ = strings.Cut(block, "```")
	line := regexp.MustCompile(`^(\S+) --> (\S+?)(?:: (.+))?$`)
	edges = map[lifeEdge]lifeState{}
	for l := range strings.SplitSeq(block, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "direction ") {
			continue
		}
		m := line.FindStringSubmatch(l)
		if m == nil {
			t.Fatalf("diagram line %q is not an edge", l)
		}
		from, to, label := m[1], m[2], m[3]
		switch {
		case from == "[*]":
			start = append(start, to)
			continue
		case to == "[*]":
			end = append(end, from)
			continue
		case label == "":
			t.Fatalf("diagram edge %q names no event", l)
		}
		for ev := range strings.SplitSeq(label, ", ") {
			k := lifeEdge{lifeState(from), lifeEvent(ev)}
			if prev, dup := edges[k]; dup {
				t.Fatalf("diagram: %q from %s leads to both %s and %s", ev, from, prev, to)
			}
			edges[k] = lifeState(to)
		}
	}
	return edges, start, end
}

// TestLifeTransitions: every (state, event) pair goes through transit,
// which moves the pod to the target the diagram in docs/how-it-works.md
// draws for it, and refuses (an error, counted, the life untouched) every
// pair the diagram does not have. So the diagram, the table and the
// function cannot drift apart.
func TestLifeTransitions(t *testing.T) {
	diagram, _, _ := docsLife(t)
	known := map[lifeEdge]bool{}
	a, err := NewAgent(Config{Rules: newRecordedRules(), Layout: nodefiles.InDir(t.TempDir())})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range allStates {
		for _, ev := range allEvents {
			k := lifeEdge{s, ev}
			known[k] = true
			want, valid := diagram[k]
			l := &podLife{uid: "u1", state: s}
			held := &entry{}
			if s.held() {
				l.entry = held
			}
			var e *entry
			if ev == evCapture || ev == evRestore {
				e = &entry{}
			}
			before := a.InvalidTransitions()
			a.mu.Lock()
			err := a.transit(l, ev, e)
			a.mu.Unlock()
			refused := a.InvalidTransitions() - before
			if !valid {
				if err == nil || refused != 1 || l.state != s || (s.held() && l.entry != held) {
					t.Errorf("%s in %s (not in the diagram): err %v, refused %d, now %s", ev, s, err, refused, l.state)
				}
				continue
			}
			if err != nil || refused != 0 || l.state != want {
				t.Errorf("%s in %s: err %v, refused %d, now %s; the diagram says %s", ev, s, err, refused, l.state, want)
				continue
			}
			switch {
			case want.held() && e != nil && l.entry != e:
				t.Errorf("%s in %s: the life is not held by the event's entry", ev, s)
			case want.held() && e == nil && l.entry != held:
				t.Errorf("%s in %s: the life lost its entry", ev, s)
			case want.held() && l.entry.State != PodState(want):
				t.Errorf("%s in %s: the entry says %s, the life %s", ev, s, l.entry.State, want)
			case !want.held() && l.entry != nil:
				t.Errorf("%s in %s: %s still holds an entry", ev, s, want)
			}
		}
	}
	for k, to := range diagram {
		if !known[k] {
			t.Errorf("diagram edge %s --> %s: %s names an unknown state or event", k.from, to, k.ev)
		}
	}
	// An event that takes the pod comes with its entry, and only such.
	for _, tc := range []struct {
		s  lifeState
		ev lifeEvent
		e  *entry
	}{{stateUncaptured, evCapture, nil}, {statePending, evAck, &entry{}}, {stateEnabled, evUnenroll, &entry{}}} {
		l := &podLife{uid: "u1", state: tc.s, entry: &entry{}}
		a.mu.Lock()
		err := a.transit(l, tc.ev, tc.e)
		a.mu.Unlock()
		if err == nil || l.state != tc.s {
			t.Errorf("%s in %s with entry %v: err %v, now %s", tc.ev, tc.s, tc.e != nil, err, l.state)
		}
	}
}

// TestLifeDiagramEnds: in the diagram a pod's life starts uncaptured and
// may end (the agent drops the life) in every state that does not hold
// it, and only there.
func TestLifeDiagramEnds(t *testing.T) {
	_, start, end := docsLife(t)
	if len(start) != 1 || start[0] != string(stateUncaptured) {
		t.Errorf("diagram starts in %v, want [uncaptured]", start)
	}
	var want []string
	for _, s := range allStates {
		if !s.held() {
			want = append(want, string(s))
		}
	}
	if strings.Join(end, ",") != strings.Join(want, ",") {
		t.Errorf("diagram ends in %v, want %v (every state that does not hold the pod, in allStates' order)", end, want)
	}
}

// TestSnapshotAckDuringFailedCapture: a ztunnel that connects while a new
// pod's capture is in flight acks the pod in its snapshot; the rules then
// fail to apply and the capture is undone. The pod must not be annotated
// enabled: istiod would send HBONE to a pod nothing redirects, which no
// ztunnel serves any more.
func TestSnapshotAckDuringFailedCapture(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	h.rules.setApplyErr(errors.New("injected apply failure"))
	h.rules.mu.Lock()
	h.rules.onApply = func() {
		// The snapshot a connecting ztunnel gets, and its ack.
		for _, w := range h.agent.Workloads() {
			h.agent.SnapshotAcked(w.UID, w.Netns)
		}
	}
	h.rules.mu.Unlock()
	if _, err := h.add(context.Background(), info("shop/web", "u1", "sb1"), pn); err == nil || !IsRetryable(err) {
		t.Fatalf("ADD with failing rules: %v, want a retryable error", err)
	}
	if got := h.annotations(t, "u1"); got != "" {
		t.Errorf("annotation writes %q for a pod whose capture was undone, want none", got)
	}
	if p := h.agent.Pods(); len(p) != 0 {
		t.Errorf("state after the undone capture: %+v", p)
	}
}

// TestSnapshotAckDuringCapture: the same ack during a capture that
// succeeds makes the pod enabled, even when the capture's own ztunnel Add
// fails.
func TestSnapshotAckDuringCapture(t *testing.T) {
	h := newHarness(t)
	pn := testnet.NewNS(t)
	h.kube.SetPod(pod("shop", "web", "u1", nil))
	h.zt.mu.Lock()
	h.zt.addErr = errors.New("injected: the Add's connection went away")
	h.zt.mu.Unlock()
	h.rules.mu.Lock()
	h.rules.onApply = func() {
		for _, w := range h.agent.Workloads() {
			h.agent.SnapshotAcked(w.UID, w.Netns)
		}
	}
	h.rules.mu.Unlock()
	if _, err := h.add(context.Background(), info("shop/web", "u1", "sb1"), pn); err == nil {
		t.Fatal("ADD whose ztunnel Add failed: no error")
	}
	if p := h.agent.Pods(); len(p) != 1 || p[0].State != StateEnabled {
		t.Fatalf("state after a capture a snapshot acked: %+v", p)
	}
	if got := h.annotations(t, "u1"); got != "enabled" {
		t.Errorf("annotation writes %q, want enabled", got)
	}
}

// TestNoPodTableOutsideLives: the package keeps no table of pods beside
// the lives: no struct field of its production code is a map keyed by a
// pod uid but lifeTable.lives. Whatever the agent knows of a pod is in
// its life.
func TestNoPodTableOutsideLives(t *testing.T) {
	fset := token.NewFileSet()
	paths, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, path := range paths {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		ast.Inspect(f, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok {
				return true
			}
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				return true
			}
			for _, fld := range st.Fields.List {
				m, ok := fld.Type.(*ast.MapType)
				if !ok || types.ExprString(m.Key) != "types.UID" {
					continue
				}
				for _, name := range fld.Names {
					if ts.Name.Name+"."+name.Name != "lifeTable.lives" {
						t.Errorf("%s: %s.%s is a table of pods beside the lives; keep it in podLife", fset.Position(fld.Pos()), ts.Name.Name, name.Name)
					}
				}
			}
			return true
		})
	}
}

// TestLifeHoldsAnnotationAndRecord: a captured pod's capture record and
// the annotation written on it are in its life; once unenrolled, what
// the agent still remembers of it (the removal it wrote, kept because the
// pod cache may lag) is in its life too, until its object is gone. No
// count of what the agent knows of pods exceeds its lives.
func TestLifeHoldsAnnotationAndRecord(t *testing.T) {
	h := newHarness(t)
	ctx := context.Background()
	p := pod("shop", "web", "u1", nil)
	h.kube.SetPod(p)
	within := func(when string) {
		t.Helper()
		sz := h.agent.TableSizes()
		for k, n := range sz {
			if n > sz["lives"] && k != "torn" {
				t.Errorf("%s: %s counts %d pods, lives only %d: %v", when, k, n, sz["lives"], sz)
			}
		}
	}
	if err := h.agent.Capture(ctx, p, openNS(t, testnet.NewNS(t)), nil); err != nil {
		t.Fatal(err)
	}
	if got := h.annotations(t, "u1"); got != "enabled" {
		t.Fatalf("annotations %q", got)
	}
	within("captured")
	h.agent.mu.Lock()
	l := h.agent.lives["u1"]
	ok := l != nil && l.record != nil && l.recordGen != 0 && l.annotation.hasWritten && l.annotation.written == "enabled"
	h.agent.mu.Unlock()
	if !ok {
		t.Errorf("the captured pod's life lacks its record or its written annotation: %+v", l)
	}
	if err := h.agent.Unenroll(ctx, "u1"); err != nil {
		t.Fatal(err)
	}
	if got := h.annotations(t, "u1"); got != "enabled," {
		t.Fatalf("annotations %q, want the removal written", got)
	}
	within("unenrolled")
	h.agent.mu.Lock()
	l = h.agent.lives["u1"]
	ok = l != nil && l.record == nil && l.recordGen == 0 && l.annotation.hasWritten && l.annotation.written == "" && l.state == stateReleased
	h.agent.mu.Unlock()
	if !ok {
		t.Errorf("the unenrolled pod's life: %+v, want released, no record, the removal written", l)
	}
	h.agent.PodGone("u1")
	if sz := h.agent.TableSizes(); sz["lives"] != 0 {
		t.Errorf("lives left once the pod is gone: %v", sz)
	}
}
