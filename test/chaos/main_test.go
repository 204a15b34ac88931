package chaos

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/bench"
	"github.com/ambient-cni/ambient-cni/test/cnibin"
	"github.com/ambient-cni/ambient-cni/test/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/podproc"
	"github.com/ambient-cni/ambient-cni/test/testnet"
)

// longEnv turns the suite on; make test-long sets it.
const longEnv = "AMBIENT_TEST_LONG"

// kube is the etcd + kube-apiserver of every test but the outage one,
// which stops its own.
var kube kubeenv.Shared

func TestMain(m *testing.M) {
	if os.Getenv(longEnv) == "1" && os.Getenv("AMBIENT_UNIT_ONLY") == "" && os.Geteuid() == 0 {
		code, reexec, err := bench.PrivateNetns()
		if err != nil {
			fmt.Fprintln(os.Stderr, "chaos: run in a network namespace of its own:", err)
			os.Exit(1)
		}
		if reexec {
			os.Exit(code)
		}
	}
	code := kube.Run(m)
	if shippedDir != "" {
		_ = os.RemoveAll(shippedDir)
	}
	os.Exit(code)
}

// requireLong skips unless the long suite was asked for, and checks every
// prerequisite (a missing one fails under CI=true).
func requireLong(t *testing.T) {
	t.Helper()
	if os.Getenv(longEnv) != "1" {
		t.Skipf("the fault-injection suite takes minutes: make test-long runs it (%s=1)", longEnv)
	}
	if os.Getenv("AMBIENT_UNIT_ONLY") != "" {
		t.Skip("skipping: AMBIENT_UNIT_ONLY is set")
	}
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "make", "go", "nft", "iptables-save", "ip6tables-save")
	for _, tool := range []string{kubeenv.Etcd, kubeenv.KubeAPIServer, kubeenv.Helm} {
		kubeenv.RequireTool(t, tool)
	}
	podproc.RequireHierarchies(t)
	cnibin.Paths(t)
}

// shipped is what the tests run: the binaries make build builds, and the
// chart's rendered defaults.
type shipped struct {
	installCNI, plugin string
	chart              *bench.Shipped
	roles              []byte
}

var (
	shippedOnce sync.Once
	shippedVal  *shipped
	shippedErr  error
	// shippedDir holds the built binaries until the test process ends.
	shippedDir string
)

// shippedBuild builds bin/install-cni and bin/ambient-cni as make build
// does (into a directory of the test run) and renders the chart, once.
func shippedBuild(t *testing.T) *shipped {
	t.Helper()
	shippedOnce.Do(func() {
		root, err := kubeenv.RepoRoot()
		if err != nil {
			shippedErr = err
			return
		}
		if shippedDir, err = os.MkdirTemp("", "achaos-bin-"); err != nil {
			shippedErr = err
			return
		}
		bin := filepath.Join(shippedDir, "bin")
		if out, err := exec.Command("make", "-C", root, "--no-print-directory", "build", "BIN="+bin).CombinedOutput(); err != nil {
			shippedErr = fmt.Errorf("make build: %v\n%s", err, out)
			return
		}
		chart, err := bench.RenderChart(context.Background(), root)
		if err != nil {
			shippedErr = err
			return
		}
		roles, err := kubeenv.ExtractRoles(chart.Manifest)
		if err != nil {
			shippedErr = err
			return
		}
		shippedVal = &shipped{
			installCNI: filepath.Join(bin, "install-cni"), plugin: filepath.Join(bin, "ambient-cni"),
			chart: chart, roles: roles,
		}
	})
	if shippedErr != nil {
		t.Fatalf("shipped binaries: %v", shippedErr)
	}
	return shippedVal
}
