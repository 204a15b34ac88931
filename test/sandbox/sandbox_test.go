package sandbox

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/cnibin"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// installCNIEnv hands the install-cni binary built outside to the test's
// run in its own network namespace.
const installCNIEnv = "AMBIENT_SANDBOX_TEST_INSTALL_CNI"

// TestSandboxDemo runs what `make sandbox` runs, so the README's first
// command stays true.
func TestSandboxDemo(t *testing.T) {
	testnet.RequireRoot(t)
	testnet.RequireCommands(t, "nsenter", "iptables-save")
	kubeenv.RequireTool(t, kubeenv.Etcd)
	kubeenv.RequireTool(t, kubeenv.KubeAPIServer)
	// The sandbox takes the network namespace it runs in for the node's
	// host: install-cni's host probe set and rule, the bridge and the pod
	// gateway go there. The test gives it a namespace of its own, or they
	// would meet (and install-cni's uninstall at the end would remove)
	// those of any other agent on the machine: a real node's, another test
	// run's. Builds, which may download, happen before, outside.
	bin := os.Getenv(installCNIEnv)
	if !testnet.InOwnNetns() {
		root, err := kubeenv.RepoRoot()
		if err != nil {
			t.Fatal(err)
		}
		bin = filepath.Join(t.TempDir(), "install-cni")
		build := exec.Command("go", "build", "-o", bin, "./cmd/install-cni")
		build.Dir = root
		if out, err := build.CombinedOutput(); err != nil {
			t.Fatalf("build install-cni: %v\n%s", err, out)
		}
		if err := cnibin.Prefetch(); err != nil {
			t.Fatalf("build the reference CNI plugins: %v", err)
		}
	}
	if !testnet.RunInOwnNetns(t, installCNIEnv+"="+bin) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out bytes.Buffer
	if err := Run(ctx, Options{Dir: t.TempDir(), InstallCNI: bin, Out: &out}); err != nil {
		t.Fatalf("sandbox: %v\n%s", err, out.String())
	}
	t.Log(out.String())
	for _, want := range []string{
		"client -> ", "reached the app directly",
		"through ztunnel via client:15001 then server:15008",
		"outsider -> ", "through ztunnel via server:15006",
		`ambient.istio.io/redirection="enabled"`,
		"annotations removed, rules and ztunnel listeners gone",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("sandbox output lacks %q", want)
		}
	}
	_, after, _ := strings.Cut(out.String(), "annotations removed, rules and ztunnel listeners gone\n")
	if next, _, _ := strings.Cut(after, "\n"); !strings.Contains(next, "reached the app directly") {
		t.Errorf("after the label is removed traffic should flow directly; got %q", next)
	}
}
