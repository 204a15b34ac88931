// Package nodeagent is the node agent's core and its plugin event server,
// wired by install-cni and driven by the pod controller too.
//
// Which file holds what, callers first: a file calls only files below it,
// never one above it or beside it on the same line (go run ./hack/walk
// measures each event's walk through them; docs/architecture.md has the
// figures).
//
//   - server.go, verify.go, delqueue.go: the plugin's requests on the
//     agent's Unix socket (ADD, CHECK, DEL, GC, STATUS), the heartbeat and
//     the ADD-spool re-check; the verifier's way in (InPod, Recapture); the
//     DEL queue, which replays the DELs the plugin spooled (DrainSpool,
//     RunSpoolDrain).
//   - capture.go, restore.go, remove.go: the ways a pod comes in (Capture:
//     planCapture and runCapture; CHECK), comes back after a restart
//     (Restore, RestoreUnresolved), and goes out (Unenroll, RemoveSandbox,
//     GC, Release, ReleaseAll, ClearStale, PodGone).
//   - state.go: reading the enrolled-pod state (the ZDS snapshot, metrics,
//     Inspect).
//   - removal.go: every way out as a plan, then its execution: the facts
//     a plan depends on (which pod a DEL names, whether it names its
//     sandbox, what the pod cache says), planRemoval (pure: an event and
//     the facts to an ordered list of steps) and runRemoval, which carries
//     the steps out.
//   - probeset.go, spool.go: the host's kubelet-probe SNAT set; draining
//     one of the plugin's spools.
//   - agent.go: the Agent, its Config and types.
//   - annotations.go, record.go, snapshot.go, errors.go: the annotation
//     writer, the capture records, the enablement snapshot, the error
//     kinds.
//   - life.go: each pod's life (podLife: its lock, state, held entry, what
//     a DEL left remembered, its annotation wanted and written, its
//     capture record and the record's generation), the lifeTable that
//     holds the lives, and transit, the one function that changes a
//     pod's state, checked against the diagram in docs/how-it-works.md.
//
// The ADD path: server.go decides with the pod cache and opens the
// runtime's netns only for a pod that will be captured; Capture plans
// (planCapture, pure, like planRemoval) and carries out (runCapture) the
// steps: write the capture record, apply the rules, add the pod's IPs to
// the probe set, hand the pod to ztunnel, and queue the annotation. The
// controller's enroll and the verifier's recapture are the same plan with
// their own guards.
//
// The removal path: a CNI DEL (RemoveSandbox; also replayed by the DEL
// queue, or for sandboxes GC finds gone) lets the rules go with the
// namespace and forgets the pod: state, ztunnel, probe set, record, no API
// request; a replayed DEL first removes our rules from a namespace the
// runtime left in place. The controller's Unenroll and the startup
// Release remove the rules first, then the probe-set IPs, then the
// annotation, and only then the record, so every crash point is one the
// next agent repairs. ReleaseAll does the same for every pod at an
// uninstall. A pod known only by its record is released through it.
//
// Namespaces themselves (the held handles, which paths the plugin may name,
// finding running pods' namespaces in /proc) are pkg/netns's.
package nodeagent
