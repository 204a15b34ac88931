package installer

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containernetworking/cni/libcni"
)

// addSeeds adds every golden input and every file in testdata/seeds/<name>
// as a seed; go test also replays testdata/fuzz/<name> on its own.
func addSeeds(f *testing.F, name string) {
	files, _ := filepath.Glob(filepath.Join("testdata", "chain", "*", "in.*"))
	seeds, _ := filepath.Glob(filepath.Join("testdata", "seeds", name, "*"))
	for _, p := range append(files, seeds...) {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		kind := uint8(0)
		switch filepath.Ext(p) {
		case ".conf":
			kind = 1
		case ".json":
			kind = 2
		}
		f.Add(b, kind)
	}
}

// exactPlugins returns the compacted plugins of a list the way libcni
// finds them (exact "plugins" key), or nil.
func exactPlugins(conf []byte) [][]byte {
	var doc map[string]json.RawMessage
	if json.Unmarshal(conf, &doc) != nil {
		return nil
	}
	var ps []json.RawMessage
	if json.Unmarshal(doc["plugins"], &ps) != nil {
		return nil
	}
	out := make([][]byte, len(ps))
	for i, p := range ps {
		out[i] = compact(p)
	}
	return out
}

// splitOurs separates our entries from the others.
func splitOurs(ps [][]byte) (ours int, others [][]byte) {
	for _, p := range ps {
		if typ, _ := pluginTypeOf(p); typ == testType {
			ours++
		} else {
			others = append(others, p)
		}
	}
	return ours, others
}

func FuzzChainInto(f *testing.F) {
	addSeeds(f, "FuzzChainInto")
	names := []string{"f.conflist", "f.conf", "f.json"}
	f.Fuzz(func(t *testing.T, in []byte, kind uint8) {
		name := names[int(kind)%len(names)]
		keep := bytes.Clone(in)
		out, newName, err := ChainInto(in, name, testEntry, testType)
		if !bytes.Equal(in, keep) {
			t.Fatal("input modified")
		}
		if err != nil {
			return
		}
		if filepath.Ext(newName) != ConflistExt {
			t.Fatalf("new name %q", newName)
		}
		// The runtime loads the result and ends the chain with us, once.
		list, err := libcni.NetworkConfFromBytes(out)
		if err != nil {
			t.Fatalf("libcni rejects output: %v\n%s", err, out)
		}
		if list.Plugins[len(list.Plugins)-1].Network.Type != testType {
			t.Fatalf("last plugin is not ours:\n%s", out)
		}
		outPlugins := exactPlugins(out)
		n, others := splitOurs(outPlugins)
		if n != 1 {
			t.Fatalf("%d entries of ours:\n%s", n, out)
		}
		// Everything else is unchanged, in order.
		var want [][]byte
		if name == "f.conflist" {
			_, want = splitOurs(exactPlugins(in))
		} else {
			want = [][]byte{compact(bytes.TrimSpace(in))}
		}
		if !equalPlugins(others, want) {
			t.Fatalf("other plugins changed:\n%q\nwant\n%q", others, want)
		}
		// Idempotent, and Unchain is its inverse.
		again, _, err := ChainInto(out, newName, testEntry, testType)
		if err != nil || !bytes.Equal(again, out) {
			t.Fatalf("not a fixpoint (err %v):\n%s\n%s", err, out, again)
		}
		un, err := Unchain(out, testType)
		if err != nil {
			t.Fatalf("Unchain: %v", err)
		}
		if name == "f.conflist" {
			inClean, err := Unchain(in, testType)
			if err != nil {
				t.Fatalf("Unchain(in) failed where ChainInto succeeded: %v", err)
			}
			if !bytes.Equal(un, inClean) {
				t.Fatalf("Unchain(ChainInto(x)) != Unchain(x):\n%s\n%s", un, inClean)
			}
		}
	})
}

func FuzzUnchain(f *testing.F) {
	addSeeds(f, "FuzzUnchain")
	f.Fuzz(func(t *testing.T, in []byte, _ uint8) {
		keep := bytes.Clone(in)
		out, err := Unchain(in, testType)
		if !bytes.Equal(in, keep) {
			t.Fatal("input modified")
		}
		if err != nil {
			return
		}
		if _, err := libcni.NetworkConfFromBytes(out); err != nil {
			t.Fatalf("libcni rejects output: %v\n%s", err, out)
		}
		nIn, othersIn := splitOurs(exactPlugins(in))
		nOut, othersOut := splitOurs(exactPlugins(out))
		if nOut != 0 {
			t.Fatalf("%d entries of ours left:\n%s", nOut, out)
		}
		if !equalPlugins(othersIn, othersOut) {
			t.Fatalf("other plugins changed:\n%q\n%q", othersOut, othersIn)
		}
		if nIn == 0 && !bytes.Equal(in, out) {
			t.Fatal("a list without our entry was changed")
		}
	})
}

// istio-cni's entries in a primary's list (someone else's file) name the
// run directory the takeover asks; each is named, one per entry libcni
// finds.
func FuzzIstioRunDirs(f *testing.F) {
	addSeeds(f, "FuzzIstioRunDirs")
	f.Fuzz(func(t *testing.T, in []byte, _ uint8) {
		dirs, err := istioRunDirs(in)
		if err != nil {
			return
		}
		list, err := libcni.ConfListFromBytes(in)
		if err != nil {
			t.Fatalf("run dirs of a list libcni refuses: %v", err)
		}
		n := 0
		for _, p := range list.Plugins {
			if p.Network.Type == IstioCNIType {
				n++
			}
		}
		if len(dirs) != n {
			t.Fatalf("%d run dirs for %d istio-cni entries", len(dirs), n)
		}
		for _, d := range dirs {
			if d == "" {
				t.Fatal("an empty run dir")
			}
		}
	})
}

// FuzzSiblingNetwork: whatever the primary's list holds, the folder our
// entry would go into is one plain name inside the conf dir, and only for
// a list libcni itself would run with its folder.
func FuzzSiblingNetwork(f *testing.F) {
	addSeeds(f, "FuzzSiblingNetwork")
	f.Fuzz(func(t *testing.T, in []byte, _ uint8) {
		network, why := siblingNetwork(in)
		if why != "" {
			if network != "" {
				t.Fatalf("refused (%s) and still named %q", why, network)
			}
			return
		}
		if !plainName(network) || strings.HasPrefix(network, ".") || filepath.Base(network) != network {
			t.Fatalf("folder %q is not one plain name", network)
		}
		list, err := libcni.NetworkConfFromBytes(in)
		if err != nil {
			return // the runtime would not load it: no primary to chain into
		}
		if list.LoadOnlyInlinedPlugins || list.Name != network {
			t.Fatalf("folder %q for a list named %q (loadOnlyInlinedPlugins %v)", network, list.Name, list.LoadOnlyInlinedPlugins)
		}
	})
}
