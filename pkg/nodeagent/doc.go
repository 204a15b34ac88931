// Package nodeagent is the node agent's core and its plugin event server,
// wired by install-cni and driven by the pod controller too. A pod's path
// reads top-down through its files:
//
//   - server.go: the plugin's requests on the agent's Unix socket; ADD
//     decides with the pod cache, then captures.
//   - capture.go: Capture, the one way a pod gets captured (rules, host
//     probe set, ztunnel, annotation), and CHECK.
//   - restore.go: adopting pods a previous agent captured.
//   - release.go: Unenroll (the controller) and RemoveSandbox (CNI DEL).
//   - gc.go: forgetting sandboxes the runtime no longer has (CNI GC, the
//     DEL spool).
//   - probeset.go: the host's kubelet-probe SNAT set.
//   - snapshot.go: the enablement snapshot the plugin falls back to.
//   - state.go: reading the enrolled-pod state.
//
// Namespaces themselves (the held handles, which paths the plugin may name,
// finding running pods' namespaces in /proc) are pkg/netns's.
package nodeagent
