package iptables

import (
	"testing"

	"github.com/containernetworking/plugins/pkg/ns"

	"github.com/ambient-cni/ambient-cni/pkg/ruleset"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// TestDetectBackend runs detection inside throwaway namespaces, so the
// host's own rules do not decide the outcome.
func TestDetectBackend(t *testing.T) {
	requireBackend(t, BackendNFT)
	requireBackend(t, BackendLegacy)
	for _, tc := range []struct{ override, want string }{{"legacy", "legacy"}, {"iptables-nft", "nft"}} {
		if got, err := DetectBackend(tc.override); err != nil || string(got) != tc.want {
			t.Errorf("override %q: %q, %v", tc.override, got, err)
		}
	}
	if _, err := DetectBackend("ebpf"); err == nil {
		t.Error("unknown override accepted")
	}
	for _, b := range []Backend{BackendNFT, BackendLegacy} {
		n := testnet.NewNS(t)
		run(t, n.Path(), b.Cmd(ruleset.IPv4), "-t", "nat", "-A", "POSTROUTING", "-j", "RETURN")
		var got Backend
		err := n.Do(func(ns.NetNS) error {
			var err error
			got, err = DetectBackend("")
			return err
		})
		if err != nil || got != b {
			t.Errorf("namespace with %s rules: detected %q, %v", b, got, err)
		}
	}
	// With no rules anywhere the default binary's mode decides.
	n := testnet.NewNS(t)
	var got Backend
	if err := n.Do(func(ns.NetNS) error {
		var err error
		got, err = DetectBackend("")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	want := modeFromVersion(run(t, "", "iptables", "--version"))
	if got != want {
		t.Errorf("empty namespace: detected %q, default binary is %q", got, want)
	}
}
