package plugin

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
)

// TestNetworkChain: the chain is the first loadable file of the network's
// name, in name order, with the network folder's plugins appended; a file
// the runtime could not load (malformed, oversized, not a regular file) is
// skipped as the runtime skips it.
func TestNetworkChain(t *testing.T) {
	dir := t.TempDir()
	write := func(rel, body string) {
		t.Helper()
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("01-other.conflist", `{"name":"other","plugins":[{"type":"istio-cni"}]}`)
	write("02-bad.conflist", `{"name":"k8s","plugins":[`)
	write("03-big.conflist", `{"name":"k8s","plugins":[{"type":"istio-cni"}],"pad":"`+strings.Repeat("x", maxChainFileBytes)+`"}`)
	if err := os.Mkdir(filepath.Join(dir, "04-dir.conf"), 0o755); err != nil {
		t.Fatal(err)
	}
	write("05-notes.txt", `{"name":"k8s","plugins":[{"type":"istio-cni"}]}`)
	write("10-k8s.conflist", `{"name":"k8s","plugins":[{"type":"bridge"},{"type":"ambient-cni"}]}`)
	write("20-k8s.conflist", `{"name":"k8s","plugins":[{"type":"istio-cni"}]}`)

	file, types, _, err := networkChain(dir, "k8s")
	if err != nil {
		t.Fatal(err)
	}
	if filepath.Base(file) != "10-k8s.conflist" || !slices.Equal(types, []string{"bridge", "ambient-cni"}) {
		t.Fatalf("chain %s %v, want 10-k8s.conflist bridge,ambient-cni", file, types)
	}
	if ok, why := istioCNIChained(dir, "k8s", time.Now().Add(time.Hour)); ok {
		t.Errorf("istio-cni chained by a file the runtime does not load: %s", why)
	}

	// The network's folder (libcni 1.3) appends its plugins.
	write("k8s/zz-istio.conf", `{"cniVersion":"1.0.0","name":"k8s","type":"istio-cni"}`)
	write("k8s/bad.conf", `not json`)
	_, types, changed, err := networkChain(dir, "k8s")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(types, []string{"bridge", "ambient-cni", "istio-cni"}) {
		t.Fatalf("chain with the folder %v", types)
	}
	if ok, why := istioCNIChained(dir, "k8s", changed.Add(istioCNIChainSettle)); !ok {
		t.Errorf("istio-cni in the folder, settled: not chained: %s", why)
	}
	if ok, _ := istioCNIChained(dir, "k8s", changed.Add(istioCNIChainSettle/2)); ok {
		t.Error("istio-cni chained before the settle time")
	}

	// A list that loads only its inlined plugins: the folder is not run.
	write("10-k8s.conflist", `{"name":"k8s","loadOnlyInlinedPlugins":true,"plugins":[{"type":"bridge"},{"type":"ambient-cni"}]}`)
	if ok, why := istioCNIChained(dir, "k8s", time.Now().Add(time.Hour)); ok {
		t.Errorf("istio-cni in the folder of a list that loads only its inlined plugins: chained (%s)", why)
	}

	for _, c := range []struct{ dir, network string }{{"", "k8s"}, {dir, "none"}, {filepath.Join(dir, "missing"), "k8s"}} {
		if ok, why := istioCNIChained(c.dir, c.network, time.Now().Add(time.Hour)); ok || why == "" {
			t.Errorf("dir %q network %q: chained %v (%q), want not, with a reason", c.dir, c.network, ok, why)
		}
	}
}

// TestChainTypesRefusesMalformed: what is not a config file with a name
// and plugins (or a type) is refused.
func TestChainTypesRefusesMalformed(t *testing.T) {
	for _, b := range []string{``, `null`, `[]`, `{"plugins":[{"type":"x"}]}`, `{"name":"k8s"}`, `{"name":"k8s","plugins":{"type":"x"}}`, `{"name":1,"plugins":[]}`, `{"name":"k8s","plugins":[1]}`, `{"name":"k8s","plugins":[]}`} {
		if name, types, _, err := chainTypes([]byte(b)); err == nil {
			t.Errorf("%q: %q %v, want an error", b, name, types)
		}
	}
}

func FuzzChainTypes(f *testing.F) {
	fuzzseed.Add(f, "FuzzChainTypes")
	f.Fuzz(func(t *testing.T, b []byte) {
		name, types, _, err := chainTypes(b)
		if err != nil {
			return
		}
		if name == "" || types == nil {
			t.Fatalf("parsed %q as network %q with types %v", b, name, types)
		}
	})
}
