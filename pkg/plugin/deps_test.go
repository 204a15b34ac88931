package plugin

import (
	"os/exec"
	"strings"
	"testing"
)

// TestPluginBinaryStaysThin guards the plugin binary's dependency set: the
// runtime execs it for every pod, so it must not pull in the Kubernetes
// API types or client, net/http or TLS (the fallback binary asks the API
// server, exec'd only when the agent cannot answer), metrics, protobuf, netlink or the rules
// backends, nor the CNI library's skel and what only it needs (its name
// regexps, its netns packages): the plugin's own dispatcher replaces it.
func TestPluginBinaryStaysThin(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go command not available")
	}
	if mod, err := exec.Command("go", "env", "GOMOD").Output(); err != nil || !strings.HasSuffix(strings.TrimSpace(string(mod)), "go.mod") {
		t.Skip("not run from inside the module")
	}
	out, err := exec.Command("go", "list", "-deps", "github.com/ambient-cni/ambient-cni/cmd/cni-plugin").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	deps := strings.Fields(string(out))
	forbidden := []string{"k8s.io/", "net/http", "crypto/tls", "crypto/x509", "os/exec", "github.com/ambient-cni/ambient-cni/pkg/fallback", "github.com/ambient-cni/ambient-cni/pkg/ambient/enablement", "k8s.io/client-go", "github.com/prometheus/", "google.golang.org/protobuf", "github.com/vishvananda/netlink",
		"github.com/coreos/go-iptables", "github.com/containernetworking/plugins/", "github.com/ambient-cni/ambient-cni/pkg/nodeagent",
		"github.com/google/nftables", "github.com/mdlayher/", "github.com/ambient-cni/ambient-cni/pkg/iptables",
		"github.com/ambient-cni/ambient-cni/pkg/nftables", "github.com/ambient-cni/ambient-cni/pkg/rulesbackend",
		"github.com/containernetworking/cni/pkg/skel", "github.com/containernetworking/cni/pkg/utils", "github.com/containernetworking/cni/pkg/ns",
		"github.com/vishvananda/netns", "regexp"}
	for _, d := range deps {
		for _, f := range forbidden {
			if strings.HasPrefix(d, f) {
				t.Errorf("plugin binary depends on %s", d)
			}
		}
	}
	t.Logf("plugin binary: %d packages", len(deps))
}
