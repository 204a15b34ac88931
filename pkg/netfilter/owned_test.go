package netfilter

import (
	"context"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/containernetworking/plugins/pkg/ns"
	"golang.org/x/sys/unix"
)

// sh runs a command inside the namespace and returns its output.
func sh(t *testing.T, n ns.NetNS, name string, args ...string) string {
	t.Helper()
	var out []byte
	err := n.Do(func(ns.NetNS) error {
		var err error
		out, err = exec.CommandContext(context.Background(), name, args...).CombinedOutput()
		return err
	})
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
	return string(out)
}

func TestOwnedTables(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft", "iptables-nft")
	n := testnet.NewNS(t)
	path := n.Path()
	nat, mangle, raw6 := TableRef{FamilyIPv4, "nat"}, TableRef{FamilyIPv4, "mangle"}, TableRef{FamilyIPv6, "raw"}

	// Someone else's empty table, there before us.
	sh(t, n, "nft", "add", "table", "ip", "nat")
	post := BaseChain{Table: nat, Name: "POSTROUTING", Type: "nat", Hook: unix.NF_INET_POST_ROUTING, Priority: 100}
	out := BaseChain{Table: mangle, Name: "OUTPUT", Type: "route", Hook: unix.NF_INET_LOCAL_OUT, Priority: -150}
	created, err := CreateOwned(path, []TableRef{nat, mangle, raw6, mangle}, []BaseChain{post, out})
	if err != nil {
		t.Fatal(err)
	}
	// The chain in the new table needs no mark; the one in the old does.
	if !slices.Equal(created.Tables, []TableRef{mangle, raw6}) || !slices.Equal(created.Chains, []BaseChain{post}) {
		t.Fatalf("created %v", created)
	}
	ruleset := sh(t, n, "nft", "list", "ruleset")
	if strings.Count(ruleset, OwnerComment) != 3 || !strings.Contains(ruleset, "type nat hook postrouting priority srcnat; policy accept;") {
		t.Fatalf("ruleset after create:\n%s", ruleset)
	}
	if again, err := CreateOwned(path, []TableRef{mangle, raw6}, []BaseChain{post}); err != nil || !again.Empty() {
		t.Fatalf("second create: %v %v", again, err)
	}

	// iptables-nft uses our table and chain like its own.
	sh(t, n, "iptables-nft", "-t", "mangle", "-A", "OUTPUT", "-j", "MARK", "--set-mark", "1")
	sh(t, n, "iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-j", "RETURN")
	sh(t, n, "iptables-nft", "-t", "nat", "-A", "OUTPUT", "-j", "RETURN")
	if del, err := DeleteOwned(path, []TableRef{nat, mangle, raw6}); err != nil || !slices.Equal(del.Tables, []TableRef{raw6}) || len(del.Chains) != 0 {
		t.Fatalf("delete with rules in place: %v %v", del, err)
	}
	sh(t, n, "iptables-nft", "-t", "nat", "-D", "POSTROUTING", "-j", "RETURN")
	if del, err := DeleteOwned(path, []TableRef{nat}); err != nil || len(del.Tables) != 0 || len(del.Chains) != 1 || del.Chains[0].Name != "POSTROUTING" {
		t.Fatalf("delete of our emptied chain: %v %v", del, err)
	}
	if out := sh(t, n, "nft", "list", "table", "ip", "nat"); strings.Contains(out, "POSTROUTING") || !strings.Contains(out, "chain OUTPUT") {
		t.Fatalf("ip nat after deleting our chain:\n%s", out)
	}
	sh(t, n, "iptables-nft", "-t", "mangle", "-D", "OUTPUT", "-j", "MARK", "--set-mark", "1")
	// A named set makes the table not empty either.
	sh(t, n, "nft", "add", "set", "ip", "mangle", "s", "{ type ipv4_addr; }")
	if del, err := DeleteOwned(path, []TableRef{mangle}); err != nil || !del.Empty() {
		t.Fatalf("delete with a set in place: %v %v", del, err)
	}
	sh(t, n, "nft", "delete", "set", "ip", "mangle", "s")
	if del, err := DeleteOwned(path, []TableRef{nat, mangle}); err != nil || !slices.Equal(del.Tables, []TableRef{mangle}) {
		t.Fatalf("delete of the emptied table: %v %v", del, err)
	}
	ruleset = sh(t, n, "nft", "list", "ruleset")
	if strings.Contains(ruleset, "mangle") || !strings.Contains(ruleset, "table ip nat {") {
		t.Fatalf("ruleset after delete:\n%s", ruleset)
	}
	if del, err := DeleteOwned(path, []TableRef{mangle}); err != nil || !del.Empty() {
		t.Fatalf("delete of a missing table: %v %v", del, err)
	}
	if _, err := CreateOwned("/nonexistent/netns", []TableRef{nat}, nil); err == nil {
		t.Fatal("bad netns accepted")
	}
}

func TestUdataComment(t *testing.T) {
	for _, s := range []string{"", "x", OwnerComment} {
		if got := udataComment(udataWithComment(s)); got != s {
			t.Errorf("%q round trip: %q", s, got)
		}
	}
	for _, b := range [][]byte{nil, {0}, {0, 5, 'a'}, {1, 1, 'x'}, {0xa1, 2, 1, 2, 0, 2, 'y', 0}} {
		_ = udataComment(b) // must not panic on truncated or foreign data
	}
	if got := udataComment([]byte{0xa1, 2, 1, 2, 0, 2, 'y', 0}); got != "y" {
		t.Errorf("comment after another TLV: %q", got)
	}
}

// DeleteInert deletes another program's table once it holds nothing but
// built-in chains without rules whose policy is accept; one that still
// decides something (a rule, a user chain, a drop policy, a set) stays,
// and DeleteOwned leaves them all.
func TestDeleteInert(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nft", "iptables-nft")
	n := testnet.NewNS(t)
	path := n.Path()
	nat, mangle, raw, filter := TableRef{FamilyIPv4, "nat"}, TableRef{FamilyIPv4, "mangle"}, TableRef{FamilyIPv4, "raw"}, TableRef{FamilyIPv6, "filter"}
	all := []TableRef{nat, mangle, raw, filter}

	// As iptables-nft leaves them once its rules are gone: empty built-in
	// chains with policy accept.
	sh(t, n, "iptables-nft", "-t", "nat", "-A", "OUTPUT", "-j", "RETURN")
	sh(t, n, "iptables-nft", "-t", "nat", "-A", "PREROUTING", "-j", "RETURN")
	sh(t, n, "iptables-nft", "-t", "mangle", "-N", "KEEP")
	sh(t, n, "iptables-nft", "-t", "raw", "-A", "OUTPUT", "-j", "ACCEPT")
	sh(t, n, "ip6tables-nft", "-P", "FORWARD", "DROP")
	sh(t, n, "iptables-nft", "-t", "nat", "-F")
	if del, err := DeleteOwned(path, all); err != nil || !del.Empty() {
		t.Fatalf("DeleteOwned of others' tables: %v %v", del, err)
	}
	del, err := DeleteInert(path, all)
	if err != nil || !slices.Equal(del.Tables, []TableRef{nat}) {
		t.Fatalf("DeleteInert: %v %v; want only ip nat", del, err)
	}
	ruleset := sh(t, n, "nft", "list", "ruleset")
	for _, want := range []string{"table ip mangle", "table ip raw", "table ip6 filter"} {
		if !strings.Contains(ruleset, want) {
			t.Fatalf("%s deleted:\n%s", want, ruleset)
		}
	}
	if strings.Contains(ruleset, "table ip nat") {
		t.Fatalf("inert ip nat kept:\n%s", ruleset)
	}
	// Emptied, each goes; the drop policy keeps its table.
	sh(t, n, "iptables-nft", "-t", "mangle", "-X", "KEEP")
	sh(t, n, "iptables-nft", "-t", "raw", "-F")
	sh(t, n, "nft", "add", "set", "ip", "raw", "s", "{ type ipv4_addr; }")
	if del, err := DeleteInert(path, all); err != nil || !slices.Equal(del.Tables, []TableRef{mangle}) {
		t.Fatalf("DeleteInert after emptying: %v %v; want ip mangle", del, err)
	}
	sh(t, n, "nft", "delete", "set", "ip", "raw", "s")
	sh(t, n, "ip6tables-nft", "-P", "FORWARD", "ACCEPT")
	if del, err := DeleteInert(path, all); err != nil || !slices.Equal(del.Tables, []TableRef{raw, filter}) {
		t.Fatalf("DeleteInert of the rest: %v %v", del, err)
	}
	if ruleset := sh(t, n, "nft", "list", "ruleset"); strings.TrimSpace(ruleset) != "" {
		t.Fatalf("left:\n%s", ruleset)
	}
}
