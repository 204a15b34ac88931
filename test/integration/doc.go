// Package integration proves the node agent end to end against a real
// kube-apiserver: the whole install-cni process (cmd/install-cni/app) runs in the
// test process, with the chart's settings, on test/lib/simnode's node: under a
// ServiceAccount bound to exactly the shipped RBAC,
// next to a ztunnel stand-in on its ZDS socket and a kubelet simulator
// whose pods are real network namespaces wired by the real bridge CNI
// chain the daemon's installer chained our plugin into. The package runs
// in a network namespace of its own (TestMain), which stands in for the
// node's host namespace.
//
// The tests live in the _test.go files; this file only documents the
// package.
package integration
