// Package nodeagent is the node agent's core and its plugin event server,
// wired by install-cni and driven by the pod controller too.
//
// Which file holds what, callers first: a file calls only files below it,
// never one above it or beside it on the same line.
//
//   - server.go, verify.go: the plugin's requests on the agent's Unix
//     socket (ADD, CHECK, DEL, GC, STATUS), the heartbeat and the
//     ADD-spool re-check; the verifier's way in (InPod, Recapture).
//   - capture.go, restore.go, remove.go: the ways a pod comes in (Capture,
//     CHECK), comes back after a restart (Restore, RestoreUnresolved), and
//     goes out (Unenroll, RemoveSandbox, GC, DrainSpool, Release,
//     ReleaseAll, ClearStale, PodGone).
//   - state.go: reading the enrolled-pod state (the ZDS snapshot, metrics,
//     Inspect).
//   - removesteps.go: the steps every way out is made of: removeRules and
//     removeRulesAt (our rules), forget and drop (the state, ztunnel, the
//     handle), releaseRecord (a pod known only by its capture record),
//     clearThenForget and clearAnnotationNow (the annotation, then the
//     record), noteReleased and markTorn (what a DEL leaves remembered).
//   - probeset.go, spool.go: the host's kubelet-probe SNAT set; draining
//     the plugin's spools.
//   - agent.go: the Agent, its Config and types, the per-pod lock.
//   - life.go, annotations.go, record.go, snapshot.go, errors.go: each
//     pod's life (podLife: its lock, state, held entry and what a DEL left
//     remembered) and transit, the one function that changes its state,
//     checked against the diagram in docs/how-it-works.md; the annotation
//     writer, the capture records, the enablement snapshot, the error
//     kinds.
//
// The ADD path: server.go decides with the pod cache and opens the
// runtime's netns only for a pod that will be captured; Capture writes
// the capture record, applies the rules, adds the pod's IPs to the probe
// set, hands the pod to ztunnel, and queues the annotation.
//
// The removal path: a CNI DEL (RemoveSandbox; also replayed from the DEL
// spool, or for sandboxes GC finds gone) lets the rules go with the
// namespace and forgets the pod: state, ztunnel, probe set, record, no API
// request. The controller's Unenroll and the startup Release remove the
// rules first, then the probe-set IPs, then the annotation, and only then
// the record, so every crash point is one the next agent repairs.
// ReleaseAll does the same for every pod at an uninstall. A pod known only
// by its record goes through releaseRecord.
//
// Namespaces themselves (the held handles, which paths the plugin may name,
// finding running pods' namespaces in /proc) are pkg/netns's.
package nodeagent
