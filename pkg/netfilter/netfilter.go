// Package netfilter is the low-level nf_tables netlink layer shared by both
// rules backends (pkg/iptables and pkg/nftables): tables and chains this
// project owns, created and deleted over raw netlink where google/nftables
// cannot express it, what a namespace holds of netfilter besides our own
// tables, and the sender every nf_tables transaction goes through (one
// acknowledgement per batch, batches recorded from google/nftables and
// replayed). It knows neither backend.
package netfilter

// Seen is what a backend saw, at no extra cost, of the namespace's
// netfilter tables other than its own, for the caller that moves pods
// between backends.
type Seen struct {
	// IPTables: the namespace has ip or ip6 nf_tables tables, where
	// iptables-nft keeps its rules.
	IPTables bool
	// XTables: the namespace has x_tables tables, where iptables-legacy
	// keeps its rules.
	XTables bool
}
