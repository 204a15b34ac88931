package nodeagent

import (
	"fmt"
	"iter"
	"net/netip"
	"slices"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/netns"
)

// lifeState is where a pod is in its life with the agent: the states of
// the diagram in docs/how-it-works.md ("A pod's states").
type lifeState string

// The states. Only pending and enabled hold the pod (a netns handle, or
// none for a pod restored without it); released and forgotten say how
// the agent last let go of it.
const (
	stateUncaptured lifeState = "uncaptured"
	statePending    lifeState = lifeState(StatePending)
	stateEnabled    lifeState = lifeState(StateEnabled)
	stateReleased   lifeState = "released"
	stateForgotten  lifeState = "forgotten"
)

// held reports whether the agent holds a pod in state s.
func (s lifeState) held() bool { return s == statePending || s == stateEnabled }

// lifeEvent names what happened to a pod; its text is the label of the
// diagram's edges.
type lifeEvent string

// The events.
const (
	// evCapture: Capture put the pod's rules in (CNI ADD, the pod
	// controller, the verifier's repair), in a new namespace or again.
	evCapture lifeEvent = "capture"
	// evRestore: a restarted agent adopted a pod its predecessor captured.
	evRestore lifeEvent = "restore"
	// evAck: ztunnel acked the pod (at its Add, or in a snapshot); at a
	// restore, the annotation says a previous agent's ztunnel did.
	evAck lifeEvent = "ztunnel acked"
	// evAckTimeout: the capture's ztunnel Add failed or timed out; the
	// runtime retries the ADD.
	evAckTimeout lifeEvent = "no ack in time"
	// evUnenroll: the pod's capture was taken off (the controller's
	// Unenroll, an uninstall's ReleaseAll).
	evUnenroll lifeEvent = "unenroll"
	// evDel: a CNI DEL (live, replayed or found by GC) named the sandbox
	// the pod is held in.
	evDel lifeEvent = "CNI DEL"
	// evStop: the agent stopped (Close); the rules and the record stay for
	// the next agent to restore.
	evStop lifeEvent = "agent stopped"
)

// lifeTransitions is the state diagram: from each state, the events it
// takes and where each leads. Anything else is refused (see transit).
// TestLifeDiagramMatchesDocs holds docs/how-it-works.md to it.
var lifeTransitions = map[lifeState]map[lifeEvent]lifeState{
	stateUncaptured: {evCapture: statePending, evRestore: statePending},
	stateReleased:   {evCapture: statePending, evRestore: statePending},
	stateForgotten:  {evCapture: statePending, evRestore: statePending},
	statePending: {
		evCapture: statePending, evRestore: statePending, evAckTimeout: statePending,
		evAck: stateEnabled, evUnenroll: stateReleased, evDel: stateForgotten, evStop: stateUncaptured,
	},
	stateEnabled: {
		evCapture: statePending, evRestore: statePending,
		evUnenroll: stateReleased, evDel: stateForgotten, evStop: stateUncaptured,
	},
}

// nextState is the state event ev leads to from s; ok is false for a
// transition the diagram does not have.
func nextState(s lifeState, ev lifeEvent) (next lifeState, ok bool) {
	next, ok = lifeTransitions[s][ev]
	return next, ok
}

// podLife is everything the agent knows of one pod (by uid), in one
// place: its lock, its state, the entry it is held by (netns handle, IPs,
// rules), what a CNI DEL left remembered, its annotation (wanted and
// written) and its capture record. Lives are in the lifeTable;
// a life that holds nothing (unlocked, not held, nothing remembered) is
// dropped, so the map holds only pods in use or lately seen going.
type podLife struct {
	uid types.UID

	// mu serializes work on the pod (Agent.lock) while other pods
	// proceed in parallel; refs (guarded by Agent.mu) counts its holders
	// and waiters.
	mu   sync.Mutex
	refs int

	// The rest is guarded by Agent.mu.

	// state changes only through Agent.transit.
	state lifeState
	// entry is the pod as held (state pending or enabled); while a capture
	// of a pod not held yet runs, it is that capture's entry, in flight
	// (its rules are going in, ztunnel is being handed it), so a ztunnel
	// that connects meanwhile finds it in its snapshot. nil otherwise.
	entry *entry
	// sandboxGone: the runtime removed the pod's captured sandbox (CNI
	// DEL) and no sandbox of it was captured since; see SandboxReleased.
	sandboxGone *releasedSandbox
	// torn are the namespaces of the pod's sandboxes a CNI DEL tore down:
	// the controller must not capture the pod in one of them again while
	// the runtime finishes (a process may linger in one for a moment).
	torn map[netns.Identity]tornMark

	// annotation is the pod's redirection annotation as the annotation
	// writer knows it: the value wanted and the value last written.
	annotation podAnnotation
	// record is the pod's capture record as on disk (written by this
	// agent or left by its predecessor); nil when there is none.
	// recordGen is the generation this agent last wrote it at (0: not
	// since it was last removed); see recordStore.
	record    *Record
	recordGen uint64
}

// podAnnotation is what the annotation writer knows of one pod's
// redirection annotation.
type podAnnotation struct {
	// want is the value the pod should get, with what runs once it has
	// it; nil when nothing is left to write.
	want *wantedAnnotation
	// written is the value this agent last wrote (or found) on the
	// object, when hasWritten: a removal too, since the pod cache may
	// still show the old value for a while.
	written    string
	hasWritten bool
}

// holdsNothing reports whether the life can be dropped.
func (l *podLife) holdsNothing() bool {
	return l.refs == 0 && l.entry == nil && l.sandboxGone == nil && len(l.torn) == 0 &&
		l.annotation == (podAnnotation{}) && l.record == nil && l.recordGen == 0
}

// lifeTable is every pod's life by uid, and the lock that guards them.
// The Agent embeds it; the annotation writer and the record store keep
// their per-pod state in the same lives, through it, so no other table
// of pods exists.
type lifeTable struct {
	mu    sync.Mutex
	lives map[types.UID]*podLife
}

func newLifeTable() *lifeTable {
	return &lifeTable{lives: map[types.UID]*podLife{}}
}

// lifeLocked returns uid's life, made if there is none. t.mu is held.
func (t *lifeTable) lifeLocked(uid types.UID) *podLife {
	l := t.lives[uid]
	if l == nil {
		l = &podLife{uid: uid, state: stateUncaptured}
		t.lives[uid] = l
	}
	return l
}

// tidyLocked drops l from the map once it holds nothing. t.mu is held.
func (t *lifeTable) tidyLocked(l *podLife) {
	if l.holdsNothing() && t.lives[l.uid] == l {
		delete(t.lives, l.uid)
	}
}

// entriesLocked yields every pod held or being captured, with its entry.
// a.mu is held.
func (a *Agent) entriesLocked() iter.Seq2[types.UID, *entry] {
	return func(yield func(types.UID, *entry) bool) {
		for uid, l := range a.lives {
			if l.entry != nil && !yield(uid, l.entry) {
				return
			}
		}
	}
}

// transit is the one place a pod's state changes: it checks that ev may
// happen in l's state (lifeTransitions), refuses it otherwise (logged at
// error level and counted: a bug, never a silent overwrite), and moves l
// to the state ev leads to. An event that makes the pod held (capture,
// restore) takes e, the entry it is now held by; one that lets it go
// drops l's entry; the others leave it (e is nil). The held entry's State
// follows. a.mu is held.
func (a *Agent) transit(l *podLife, ev lifeEvent, e *entry) error {
	next, ok := nextState(l.state, ev)
	if takes := ev == evCapture || ev == evRestore; takes != (e != nil) {
		// An event that (re)takes the pod comes with what holds it, and
		// only such an event.
		ok = false
	}
	if !ok {
		a.invalidTransitions++
		err := fmt.Errorf("pod %s: invalid state transition: %q in state %q", l.uid, ev, l.state)
		a.log.Error("refused an invalid pod state transition", "uid", l.uid, "state", l.state, "event", ev)
		return err
	}
	if e != nil {
		l.entry = e
	}
	if !next.held() {
		l.entry = nil
	}
	l.state = next
	if l.entry != nil {
		l.entry.State = PodState(next)
	}
	return nil
}

// InvalidTransitions is how many pod state transitions the agent refused
// because its state diagram does not have them: a bug if ever not zero.
func (a *Agent) InvalidTransitions() uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.invalidTransitions
}

// releasedTTL is how long SandboxReleased remembers a pod: far longer than
// any pod stays between its sandbox's teardown and its object's removal.
const releasedTTL = time.Hour

// releasedSandbox is what the agent remembers of a captured sandbox the
// runtime removed: when, and the IPs it had (none when not known).
type releasedSandbox struct {
	at  time.Time
	ips []netip.Addr
}

// tornTTL is how long a namespace whose sandbox a CNI DEL tore down is
// refused to the controller.
const tornTTL = time.Minute

// tornMark is a namespace whose sandbox a CNI DEL tore down: when, and the
// IPs the sandbox had (none when not known).
type tornMark struct {
	at  time.Time
	ips []netip.Addr
}

// lock takes uid's pod lock: work on one pod is serialized while
// different pods proceed in parallel. The life lives at least until the
// returned unlock.
func (a *Agent) lock(uid types.UID) (unlock func()) {
	a.mu.Lock()
	l := a.lifeLocked(uid)
	l.refs++
	a.mu.Unlock()
	l.mu.Lock()
	return func() {
		l.mu.Unlock()
		a.mu.Lock()
		l.refs--
		a.tidyLocked(l)
		a.mu.Unlock()
	}
}

// get returns the entry uid is held by (or being captured with), if any.
func (a *Agent) get(uid types.UID) *entry {
	a.mu.Lock()
	defer a.mu.Unlock()
	if l := a.lives[uid]; l != nil {
		return l.entry
	}
	return nil
}

// noteReleasedLocked remembers that the runtime removed uid's captured
// sandbox, which had ips, unless the pod's object is gone (the caller
// asked the pod cache with a.mu held; see noteReleased), and forgets the
// marks older than releasedTTL. a.mu is held.
func (a *Agent) noteReleasedLocked(uid types.UID, ips []netip.Addr, objectGone bool) {
	now := time.Now()
	for _, l := range a.lives {
		if l.sandboxGone != nil && now.Sub(l.sandboxGone.at) > releasedTTL {
			l.sandboxGone = nil
			a.tidyLocked(l)
		}
	}
	if objectGone {
		return
	}
	a.lifeLocked(uid).sandboxGone = &releasedSandbox{at: now, ips: slices.Clone(ips)}
}

// markTorn notes that the runtime is tearing down pod uid's sandbox, whose
// namespace is id and whose IPs were ips.
func (a *Agent) markTorn(id netns.Identity, uid types.UID, ips []netip.Addr) {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.pruneTornLocked(now)
	l := a.lifeLocked(uid)
	if l.torn == nil {
		l.torn = map[netns.Identity]tornMark{}
	}
	l.torn[id] = tornMark{at: now, ips: slices.Clone(ips)}
}

// pruneTornLocked drops the marks older than tornTTL: a DEL that came after
// its pod's object was gone (PodGone ran first) leaves a mark only time
// removes. a.mu is held.
func (a *Agent) pruneTornLocked(now time.Time) {
	for _, l := range a.lives {
		for id, m := range l.torn {
			if now.Sub(m.at) > tornTTL {
				delete(l.torn, id)
			}
		}
		a.tidyLocked(l)
	}
}

// tornDown reports whether a CNI DEL lately tore down pod uid's sandbox
// whose namespace is ns. The pod counts, not only the identity: once a
// namespace is freed the kernel reuses its inode number, so another pod's
// new namespace can carry a torn one's identity within the minute (seen
// in make bench: 500 new pods after hundreds of DELs, some refused for a
// minute). So can the same pod's next sandbox, started right after the
// DEL (one no ADD brought to the agent, while our plugin was not chained:
// seen on the real node, the pod left uncaptured for the minute): a
// namespace holding an address the torn sandbox did not have is that new
// one, not the torn one, whose interfaces the primary's DEL removes.
func (a *Agent) tornDown(ns *netns.Handle, uid types.UID) bool {
	a.mu.Lock()
	var m tornMark
	ok := false
	if l := a.lives[uid]; l != nil {
		m, ok = l.torn[ns.Identity()]
	}
	a.mu.Unlock()
	if !ok || time.Since(m.at) > tornTTL {
		return false
	}
	if len(m.ips) == 0 {
		return true
	}
	have, err := netns.Addrs(ns.File())
	if err != nil {
		return true
	}
	return !slices.ContainsFunc(have, func(h netip.Addr) bool {
		return h.IsGlobalUnicast() && !slices.Contains(m.ips, h)
	})
}
