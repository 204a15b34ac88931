// Package cnibin builds the CNI plugins tests run through libcni: the
// reference bridge, host-local and loopback plugins of
// github.com/containernetworking/plugins (PluginsVersion), and this
// project's plugin exactly as `make build` builds it. Binaries are cached
// outside the repository, the reference plugins per version and Go
// toolchain, ours per content hash, and built at most once per test process.
// It also renders a conflist shaped like a real node's.
package cnibin

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// PluginsVersion is the containernetworking/plugins release built (the one
// go.mod pins).
const PluginsVersion = "v1.10.0"

// PluginName is our plugin's binary name, the conflist "type".
const PluginName = "ambient-cni"

// ReferencePlugins are the reference plugins built.
var ReferencePlugins = []string{"bridge", "host-local", "loopback"}

var (
	once    sync.Once
	paths   []string
	ours    string
	onceErr error
)

// Paths returns the CNI_PATH directories: the reference plugins' and
// ours. It builds what is missing (the first build of the reference
// plugins may download their modules and takes tens of seconds).
//
// With AMBIENT_UNIT_ONLY set (make test-unit) it skips the test instead.
func Paths(t testing.TB) []string {
	t.Helper()
	if os.Getenv("AMBIENT_UNIT_ONLY") != "" {
		t.Skip("skipping: needs built CNI plugins, and AMBIENT_UNIT_ONLY is set")
	}
	if _, err := exec.LookPath("go"); err != nil {
		testnet.Missing(t, "the go command is needed to build CNI plugins")
	}
	once.Do(func() { paths, ours, onceErr = Build() })
	if onceErr != nil {
		t.Fatalf("build CNI plugins: %v", onceErr)
	}
	return paths
}

// Plugin returns the path of our plugin binary.
func Plugin(t testing.TB) string {
	t.Helper()
	Paths(t)
	return ours
}

// InstallInto copies every plugin into dir, for runtimes that take a
// single bin dir.
func InstallInto(t testing.TB, dir string) {
	t.Helper()
	for _, d := range Paths(t) {
		des, err := os.ReadDir(d)
		if err != nil {
			t.Fatal(err)
		}
		for _, de := range des {
			if err := atomicfile.CopyFile(filepath.Join(d, de.Name()), filepath.Join(dir, de.Name()), atomicfile.Options{Mode: 0o755, SkipSync: true}); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func cacheRoot() (string, error) {
	base := os.Getenv("XDG_CACHE_HOME")
	if base == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", err
		}
		base = filepath.Join(home, ".cache")
	}
	return filepath.Join(base, "ambient-cni", "cnibin"), nil
}

// Build builds (or finds cached) the reference plugins and ours, and
// returns the CNI_PATH directories and our plugin's path. Tests use Paths;
// Build is for programs such as the local sandbox.
func Build() (paths []string, plugin string, err error) {
	root, err := cacheRoot()
	if err != nil {
		return nil, "", err
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return nil, "", err
	}
	ref, err := buildReference(root)
	if err != nil {
		return nil, "", err
	}
	oursDir, err := buildOurs(root)
	if err != nil {
		return nil, "", err
	}
	return []string{ref, oursDir}, filepath.Join(oursDir, PluginName), nil
}

// Prefetch builds (or finds cached) the reference plugins, the one build
// that may need the network (to download their modules the first time):
// tests that then run without a route out, in a network namespace of
// their own, find them built.
func Prefetch() error {
	root, err := cacheRoot()
	if err != nil {
		return err
	}
	if err := os.MkdirAll(root, 0o755); err != nil {
		return err
	}
	_, err = buildReference(root)
	return err
}

// buildReference builds the reference plugins inside their own module
// (its go.mod and go.sum pin their dependencies), into a directory keyed
// by plugin version and toolchain.
func buildReference(root string) (string, error) {
	dir := filepath.Join(root, fmt.Sprintf("plugins-%s-%s-%s", PluginsVersion, runtime.Version(), runtime.GOARCH))
	if complete(dir, ReferencePlugins) {
		return dir, nil
	}
	modDir, err := goOut("", "list", "-m", "-f", "{{.Dir}}", "github.com/containernetworking/plugins")
	if err != nil {
		return "", err
	}
	if modDir == "" {
		if _, err := goOut("", "mod", "download", "github.com/containernetworking/plugins@"+PluginsVersion); err != nil {
			return "", err
		}
		if modDir, err = goOut("", "list", "-m", "-f", "{{.Dir}}", "github.com/containernetworking/plugins"); err != nil {
			return "", err
		}
	}
	tmp, err := os.MkdirTemp(root, ".build-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	args := []string{"build", "-trimpath", "-o", tmp + "/"}
	args = append(args, "./plugins/main/bridge", "./plugins/ipam/host-local", "./plugins/main/loopback")
	if _, err := goOut(modDir, args...); err != nil {
		return "", err
	}
	return dir, publish(tmp, dir)
}

// buildOurs builds cmd/cni-plugin like `make build` and files it under its
// content hash, so an unchanged plugin is reused across test binaries.
func buildOurs(root string) (string, error) {
	modRoot, err := goOut("", "env", "GOMOD")
	if err != nil {
		return "", err
	}
	if modRoot == "" || modRoot == os.DevNull {
		return "", fmt.Errorf("not inside the ambient-cni module")
	}
	tmp, err := os.MkdirTemp(root, ".build-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	bin := filepath.Join(tmp, PluginName)
	if _, err := goOut(filepath.Dir(modRoot), "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "./cmd/cni-plugin"); err != nil {
		return "", err
	}
	sum, err := hashFile(bin)
	if err != nil {
		return "", err
	}
	dir := filepath.Join(root, "ambient-cni-"+sum[:16])
	if complete(dir, []string{PluginName}) {
		return dir, nil
	}
	return dir, publish(tmp, dir)
}

// publish renames a finished build dir into place; losing the race to
// another test process that published the same content is fine.
func publish(tmp, dir string) error {
	staged := tmp + ".done"
	if err := os.Rename(tmp, staged); err != nil {
		return err
	}
	if err := os.Rename(staged, dir); err != nil {
		_ = os.RemoveAll(staged)
		if _, serr := os.Stat(dir); serr == nil {
			return nil
		}
		return err
	}
	return nil
}

func complete(dir string, names []string) bool {
	for _, n := range names {
		st, err := os.Stat(filepath.Join(dir, n))
		if err != nil || !st.Mode().IsRegular() || st.Mode().Perm()&0o100 == 0 {
			return false
		}
	}
	return true
}

func goOut(dir string, args ...string) (string, error) {
	cmd := exec.Command("go", args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.Output()
	if err != nil {
		msg := ""
		if ee, ok := err.(*exec.ExitError); ok {
			msg = strings.TrimSpace(string(ee.Stderr))
		}
		return "", fmt.Errorf("go %s (in %q): %w: %s", strings.Join(args, " "), dir, err, msg)
	}
	return strings.TrimSpace(string(out)), nil
}

func hashFile(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// Network describes a node's pod network for Conflist.
type Network struct {
	// CNIVersion of the list (default "1.0.0").
	CNIVersion string
	// Name of the network (default "k8s-pod-network").
	Name string
	// Bridge is the host bridge's name (at most 15 bytes).
	Bridge string
	// Subnet (IPv4) and optional Subnet6 are the pod CIDRs.
	Subnet, Subnet6 netip.Prefix
	// DataDir is host-local's allocation store (use a test temp dir).
	DataDir string
	// Plugin holds our plugin's keys (agentSocket, timeout, ...); nil
	// leaves our plugin out of the chain.
	Plugin map[string]any
}

// Conflist renders a chain like a real node's: the bridge plugin with
// host-local IPAM as the primary network, our plugin last. IP masquerade
// is off so tests leave no host iptables rules behind.
func Conflist(n Network) []byte {
	if n.CNIVersion == "" {
		n.CNIVersion = "1.0.0"
	}
	if n.Name == "" {
		n.Name = "k8s-pod-network"
	}
	ranges := []any{[]any{map[string]any{"subnet": n.Subnet.String()}}}
	routes := []any{map[string]any{"dst": "0.0.0.0/0"}}
	if n.Subnet6.IsValid() {
		ranges = append(ranges, []any{map[string]any{"subnet": n.Subnet6.String()}})
		routes = append(routes, map[string]any{"dst": "::/0"})
	}
	plugins := []any{map[string]any{
		"type":        "bridge",
		"bridge":      n.Bridge,
		"isGateway":   true,
		"ipMasq":      false,
		"hairpinMode": true,
		"ipam": map[string]any{
			"type":    "host-local",
			"dataDir": n.DataDir,
			"ranges":  ranges,
			"routes":  routes,
		},
	}}
	if n.Plugin != nil {
		p := map[string]any{"type": PluginName}
		for k, v := range n.Plugin {
			p[k] = v
		}
		plugins = append(plugins, p)
	}
	b, err := json.MarshalIndent(map[string]any{"cniVersion": n.CNIVersion, "name": n.Name, "plugins": plugins}, "", "  ")
	if err != nil {
		panic(err) // only maps of strings, bools and slices
	}
	return b
}
