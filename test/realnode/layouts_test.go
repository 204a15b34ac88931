//go:build realnode

package realnode

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The platforms' node layouts on the real node: each its own node, its
// runtime's CNI dirs laid out as the platform's, the chart installed with
// helm's platform value. An ambient pod is captured from its first packet,
// a pod outside the mesh is left alone, and helm uninstall gives back the
// node's CNI configs byte for byte.
func TestRealNodeLayouts(t *testing.T) {
	startNodeTest(t)
	for _, l := range []Layout{LayoutGKE, LayoutK3s, LayoutMultus} {
		t.Run(string(l), func(t *testing.T) { testLayout(t, l) })
	}
}

func mustRepo(t *testing.T) string {
	t.Helper()
	r, err := repoRoot()
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func testLayout(t *testing.T, l Layout) {
	if l == LayoutMultus {
		if _, err := toolPath(mustRepo(t), "multus"); err != nil {
			testnet.Missing(t, fmt.Sprintf("the Multus thin plugin: %v; build it with hack/kube-tools.sh multus", err))
		}
	}
	ctx := context.Background()
	out := &lineWriter{t: t}
	n, err := Up(ctx, Options{Out: out, Images: testImages, Layout: l})
	if err != nil {
		t.Fatalf("node up: %v", err)
	}
	t.Cleanup(func() {
		if err := n.Down(); err != nil {
			t.Errorf("down: %v", err)
		}
	})
	confs, err := readConfs(n.ConfDirs())
	if err != nil {
		t.Fatal(err)
	}
	if err := n.InstallAgent(ctx, "install", ImageTag); err != nil {
		t.Fatalf("helm install --set platform=%s: %v", l.Platform(), err)
	}
	// helm install oci:// from the node's registry; containerd pulled
	// the agent's image from it by digest.
	if err := n.CheckAgentFromRegistry(ctx); err != nil {
		t.Error(err)
	}
	if err := n.StartStandIn(ctx); err != nil {
		t.Fatalf("ztunnel stand-in: %v", err)
	}
	e := &e2e{n: n, out: out, standIn: true}
	if _, err := os.Stat(filepath.Join(n.CNIBinDir, "ambient-cni")); err != nil {
		t.Errorf("the plugin is not in the platform's bin dir: %v", err)
	}
	checkLayoutChained(t, n, l)
	if l == LayoutGKE {
		// The profile's quota, so GKE admits the agent's priority class
		// outside kube-system.
		rqs, err := n.Client.CoreV1().ResourceQuotas(ReleaseNamespace).List(ctx, metav1.ListOptions{})
		if err != nil || len(rqs.Items) == 0 {
			t.Errorf("no ResourceQuota in %s under platform=gke (%v)", ReleaseNamespace, err)
		}
	}

	e.namespace(t, "mesh", true)
	e.namespace(t, "plain", false)
	sink := e.start(t, "plain", "sink", AppOptions{})
	// The pod's first act is its hello: it reaches the stand-in only if
	// the plugin captured the pod before its container ran.
	meshed := e.start(t, "mesh", "meshed", AppOptions{Hello: appURL(sink, "/hello-meshed")})
	e.mustCaptured(t, meshed)
	err = n.Poll(ctx, "the meshed pod's hello through the stand-in", func(ctx context.Context) (bool, error) {
		if len(e.records(t, meshed.UID, ambient.ZtunnelOutboundPort, podAddr(sink))) == 0 {
			return false, errors.New("no outbound record of its first connection")
		}
		return true, nil
	})
	if err != nil {
		t.Error(err)
	}
	if l == LayoutMultus {
		// Multus ran for the pod: it records the networks it attached.
		cur, err := n.Client.CoreV1().Pods("mesh").Get(ctx, meshed.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if st := cur.Annotations[multusStatusAnnotation]; !strings.Contains(st, `"ambient-node"`) || !strings.Contains(st, cur.Status.PodIP) {
			t.Errorf("the meshed pod's %s is %q: want Multus's record of the cluster network ambient-node with %s", multusStatusAnnotation, st, cur.Status.PodIP)
		}
	}
	plain := e.start(t, "plain", "plain", AppOptions{Hello: appURL(sink, "/hello-plain")})
	if ok, err := n.releasedNoStandIn(ctx, plain); !ok {
		t.Errorf("a pod outside the mesh: %v", err)
	}
	err = n.Poll(ctx, "the plain pod's hello, direct", func(ctx context.Context) (bool, error) {
		src, err := seenFrom(ctx, sink, "/hello-plain")
		if err != nil {
			return false, err
		}
		if src.String() != plain.Status.PodIP {
			return false, fmt.Errorf("the sink saw the plain pod's hello from %s, want its own %s", src, plain.Status.PodIP)
		}
		return true, nil
	})
	if err != nil {
		t.Error(err)
	}
	if recs := e.records(t, plain.UID, ambient.ZtunnelOutboundPort, podAddr(sink)); len(recs) > 0 {
		t.Error("the plain pod's traffic went through the stand-in")
	}

	if err := n.UninstallAgent(ctx); err != nil {
		t.Fatalf("helm uninstall: %v", err)
	}
	got, err := readConfs(n.ConfDirs())
	if err != nil {
		t.Fatal(err)
	}
	if !maps.EqualFunc(got, confs, func(a, b string) bool { return a == b }) {
		t.Errorf("CNI configs after helm uninstall:\n%s\nwant as the node had them:\n%s", dumpConfs(got), dumpConfs(confs))
	}
	if _, err := os.Stat(filepath.Join(n.CNIBinDir, "ambient-cni")); err == nil {
		t.Error("the plugin binary is still installed")
	}
}

// multusStatusAnnotation is where Multus records the networks it attached
// a pod to.
const multusStatusAnnotation = "k8s.v1.cni.cncf.io/network-status"

// checkLayoutChained checks where the installer chained: the runtime's
// primary config, which under Multus is Multus's own (so the runtime runs
// the plugin after Multus for every pod, whatever Multus delegates to).
func checkLayoutChained(t *testing.T, n *Node, l Layout) {
	t.Helper()
	file := n.CNIConfFile
	if l == LayoutMultus {
		file = filepath.Join(n.CNIConfDir, strings.TrimSuffix(MultusConfName, ".conf")+".conflist")
	}
	b, err := os.ReadFile(file)
	if err != nil {
		t.Errorf("the primary config: %v", err)
		return
	}
	first, last := strings.Index(string(b), `"type"`), strings.LastIndex(string(b), `"type"`)
	if !strings.Contains(string(b)[last:], `"ambient-cni"`) {
		t.Errorf("%s does not end with the plugin:\n%s", file, b)
	}
	if l == LayoutMultus && !strings.HasPrefix(strings.TrimLeft(string(b)[first+len(`"type"`):], ": "), `"multus"`) {
		t.Errorf("%s does not start with Multus:\n%s", file, b)
	}
}

// readConfs reads every file under dirs, by path.
func readConfs(dirs []string) (map[string]string, error) {
	out := map[string]string{}
	for _, d := range dirs {
		err := filepath.WalkDir(d, func(p string, de os.DirEntry, err error) error {
			if err != nil || de.IsDir() {
				return err
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out[p] = string(b)
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	return out, nil
}

func dumpConfs(m map[string]string) string {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(m)) {
		fmt.Fprintf(&b, "== %s\n%s\n", k, m[k])
	}
	return b.String()
}
