// Package nftables is the native nftables rules backend: the capture rules
// of pkg/ruleset rendered as nf_tables tables of their own (inet
// istio-ambient-raw, -mangle and -nat in each pod, the host's probe SNAT
// and set in the node's namespace) and sent over netlink, through
// pkg/netfilter, in one atomic batch per pod. Its sibling pkg/iptables
// renders the same model for iptables-restore; neither knows the other,
// and pkg/rulesbackend chooses between them.
//
// The files: applier.go installs, verifies and removes a pod's rules;
// render.go turns the model into tables, chains and expressions; live.go
// reads back what a namespace holds and compares it with what was
// rendered; host.go keeps the kubelet probe path on the node; probe.go
// tells whether a namespace holds our tables.
package nftables
