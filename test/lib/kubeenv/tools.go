package kubeenv

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// Names of the binaries that hack/kube-tools.sh builds.
const (
	Etcd          = "etcd"
	KubeAPIServer = "kube-apiserver"
	Kubelet       = "kubelet"
	Helm          = "helm"
	// Promtool checks and unit-tests the chart's alert rules; Prometheus
	// is the server the real node scrapes the agent with.
	Promtool   = "promtool"
	Prometheus = "prometheus"
)

// BuildCommand is what a developer runs to build the cached binaries.
const BuildCommand = "make tools (or hack/kube-tools.sh)"

// ErrToolMissing is wrapped by ToolPath when a binary is not built yet.
var ErrToolMissing = errors.New("tool not built")

// toolSpec says which tools module builds a binary and which of its
// requirements carries the version the cache is keyed by. It mirrors spec()
// in hack/kube-tools.sh; TestToolPathsMatchScript keeps the two in step.
func toolSpec(name string) (modDir, module string, err error) {
	switch name {
	case Etcd:
		return "etcd", "go.etcd.io/etcd/server/v3", nil
	case KubeAPIServer, Kubelet:
		return "kubernetes", "k8s.io/kubernetes", nil
	case Helm:
		return "helm", "helm.sh/helm/v3", nil
	case Promtool, Prometheus:
		return "prometheus", "github.com/prometheus/prometheus", nil
	}
	return "", "", fmt.Errorf("unknown tool %q", name)
}

// RepoRoot finds the repository root by walking up from the working
// directory (go test runs in the package directory) to the directory holding
// hack/kube-tools.sh.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", fmt.Errorf("working directory: %w", err)
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "hack", "kube-tools.sh")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("repository root (with hack/kube-tools.sh) not found above the working directory")
		}
		dir = parent
	}
}

// CacheDir is the root of the tools cache: $AMBIENT_TOOLS_CACHE, else
// ambient-cni/tools under the user cache directory ($XDG_CACHE_HOME or
// ~/.cache), exactly as hack/kube-tools.sh and the Makefile compute it.
func CacheDir() (string, error) {
	if d := os.Getenv("AMBIENT_TOOLS_CACHE"); d != "" {
		return d, nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("user cache dir: %w", err)
	}
	return filepath.Join(d, "ambient-cni", "tools"), nil
}

// ToolVersion reads the version a tool is built at from its tools module's
// go.mod under hack/tools.
func ToolVersion(name string) (string, error) {
	modDir, module, err := toolSpec(name)
	if err != nil {
		return "", err
	}
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	gomod := filepath.Join(root, "hack", "tools", modDir, "go.mod")
	f, err := os.Open(gomod)
	if err != nil {
		return "", fmt.Errorf("open tools module: %w", err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 3 && fields[0] == "require" && fields[1] == module {
			return fields[2], nil
		}
		if len(fields) >= 2 && fields[0] == module && strings.HasPrefix(fields[1], "v") {
			return fields[1], nil
		}
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("read %s: %w", gomod, err)
	}
	return "", fmt.Errorf("%s is not required in hack/tools/%s/go.mod", module, modDir)
}

// toolEnv is the variable that overrides a tool's path, e.g.
// AMBIENT_TOOL_KUBE_APISERVER.
func toolEnv(name string) string {
	return "AMBIENT_TOOL_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// ToolCachePath returns where hack/kube-tools.sh puts a tool's binary,
// <cache>/<name>-<version>/<name>, whether or not it is built yet.
func ToolCachePath(name string) (string, error) {
	v, err := ToolVersion(name)
	if err != nil {
		return "", err
	}
	c, err := CacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(c, name+"-"+v, name), nil
}

// ToolPath returns the path of a built tool: the file named by
// AMBIENT_TOOL_<NAME> if set, else the cached binary, once a running
// hack/kube-tools.sh that builds it has (AwaitTool). The error wraps
// ErrToolMissing when the binary is not there.
func ToolPath(name string) (string, error) {
	p := os.Getenv(toolEnv(name))
	if p == "" {
		var err error
		if p, err = ToolCachePath(name); err != nil {
			return "", err
		}
	}
	AwaitTool(name, p, stderrLog)
	st, err := os.Stat(p)
	if err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
		return "", fmt.Errorf("%s: %w at %s; build it with %s", name, ErrToolMissing, p, BuildCommand)
	}
	return p, nil
}

// RequireTool returns a tool's path, or skips the test (fails it under
// CI=true) when the tool is not built, naming the command that builds it.
// With AMBIENT_UNIT_ONLY set (make test-unit) it always skips.
func RequireTool(t testing.TB, name string) string {
	t.Helper()
	if os.Getenv("AMBIENT_UNIT_ONLY") != "" {
		t.Skipf("skipping: needs %s, and AMBIENT_UNIT_ONLY is set", name)
	}
	p, err := ToolPath(name)
	if err != nil {
		testnet.Missing(t, err.Error())
	}
	return p
}
