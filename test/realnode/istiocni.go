package realnode

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/realnode/imagearchive"
)

// Istio's own istio-cni on the node: its images built like ours (its
// binaries on the Debian base), installed with Istio's own chart.

// IstioCNITool is the tools-cache directory hack/kube-tools.sh builds from
// Istio's source: install-cni, the istio-cni plugin and Istio's istio-cni
// chart (chart/), of the minor the tests run (kubeenv.IstioTool).
func IstioCNITool() string { return kubeenv.IstioTool("istio-cni") }

// IstioCNIRelease is the helm release of Istio's istio-cni chart, named
// as Istio's install names it; its DaemonSet is istio-cni-node.
const (
	IstioCNIRelease   = "istio-cni"
	IstioCNIDaemonSet = "istio-cni-node"
)

// IstioCNIImage is the local image of Istio's install-cni.
var IstioCNIImage = imageName("istio-install-cni")

// IstioCNI is what the node needs to run Istio's istio-cni.
type IstioCNI struct {
	// Chart is Istio's istio-cni chart of the same source as its binaries.
	Chart string
	// RunDir is istio-cni's run directory on the node (its chart's
	// /var/run/istio-cni): its plugin event socket is there.
	RunDir string
}

// IstioCNIDirs returns the built IstioCNITool directory and the Istio
// istio-cni chart in it, or an error naming the command that builds them.
func IstioCNIDirs(repo string) (bin, chart string, err error) {
	bin, err = toolPath(repo, IstioCNITool())
	if err != nil {
		return "", "", fmt.Errorf("istio-cni not built (%v); build it with hack/kube-tools.sh %s", err, IstioCNITool())
	}
	chart = filepath.Join(bin, "chart")
	for _, f := range []string{filepath.Join(bin, "install-cni"), filepath.Join(bin, "istio-cni"), filepath.Join(chart, "Chart.yaml")} {
		if _, err := os.Stat(f); err != nil {
			return "", "", fmt.Errorf("istio-cni: %w (hack/kube-tools.sh %s builds it)", err, IstioCNITool())
		}
	}
	return bin, chart, nil
}

// ImportIstioCNI builds Istio's install-cni image as Istio's
// Dockerfile.install-cni lays it out (the plugin at /opt/cni/bin/istio-cni,
// install-cni on the PATH), on the Debian base with iptables and
// nftables, and imports it.
func (n *Node) ImportIstioCNI(ctx context.Context) (*IstioCNI, error) {
	bin, chart, err := IstioCNIDirs(n.Tools.Repo)
	if err != nil {
		return nil, err
	}
	top, err := imagearchive.FilesLayer(
		imagearchive.File{Path: "/opt/cni/bin/istio-cni", Mode: 0o755, Source: filepath.Join(bin, "istio-cni")},
		imagearchive.File{Path: "/usr/local/bin/install-cni", Mode: 0o755, Source: filepath.Join(bin, "install-cni")},
	)
	if err != nil {
		return nil, err
	}
	a := filepath.Join(n.Dir, "istio-install-cni.tar")
	if err := imagearchive.WriteFile(a, imagearchive.Image{
		Name: IstioCNIImage, Cmd: []string{"/usr/local/bin/install-cni"},
		// Istio's Dockerfile's: the chart's command is install-cni, by PATH.
		Env:        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/opt/cni/bin"},
		WorkingDir: "/opt/cni/bin",
		Layers:     []imagearchive.Layer{imagearchive.FileLayer(n.Tools.Rootfs), top}}); err != nil {
		return nil, fmt.Errorf("write image %s: %w", IstioCNIImage, err)
	}
	start := time.Now()
	if _, err := n.ctr(ctx, "images", "import", a); err != nil {
		return nil, err
	}
	_ = os.Remove(a)
	n.logf("   imported %s (Istio %s) in %v", IstioCNIImage, kubeenv.IstioVersion(bin), time.Since(start).Round(10*time.Millisecond))
	return &IstioCNI{Chart: chart, RunDir: filepath.Join(n.Dir, "run", "istio-cni")}, nil
}

// IstioCNIValues are the values istio-cni is installed with: an Istio
// user's ambient values (profile ambient, the rule mode), the node's
// directories, and what this machine needs (the local image; the API
// server on loopback, as no kube-proxy runs here; the node's run
// directory: the env value is Istio's way to set CNI_AGENT_RUN_DIR).
// ambient.enableAmbientDetectionRetry makes istio-cni's plugin fail a
// pod it cannot look up instead of letting it start unenrolled: the
// migration page asks for it before the switch.
func (n *Node) IstioCNIValues(ic *IstioCNI, nativeNftables bool) map[string]any {
	return map[string]any{
		"profile":     "ambient",
		"image":       IstioCNIImage,
		"pullPolicy":  "Never",
		"cniBinDir":   n.CNIBinDir,
		"cniConfDir":  n.CNIConfDir,
		"cniNetnsDir": n.NetnsDir,
		"global":      map[string]any{"nativeNftables": nativeNftables},
		"ambient": map[string]any{
			// The node's /proc/1/ns/net is unreadable here, so istio-cni
			// cannot switch into the host network from a pod network.
			"shareHostNetworkNamespace":   true,
			"enableAmbientDetectionRetry": true,
		},
		"env": map[string]any{
			"KUBERNETES_SERVICE_HOST": "127.0.0.1",
			"KUBERNETES_SERVICE_PORT": fmt.Sprint(n.APIPort),
			"CNI_AGENT_RUN_DIR":       ic.RunDir,
		},
	}
}

// istioHostProc prepares what istio-cni gets as the host's /proc: a proc
// mount of the machine's PID namespace in the node directory whose
// 1/ns/net is the host network namespace. istio-cni stats /proc/1/ns/net
// to tell the host's netns apart, and on this machine PID 1's namespaces
// are unreadable; every other process shows as in /proc. Down unmounts it
// with everything under the node directory.
func (n *Node) istioHostProc() (string, error) {
	d := filepath.Join(n.Dir, "istio-host-proc")
	if isMountPoint(d) {
		return d, nil
	}
	if err := os.MkdirAll(d, 0o755); err != nil {
		return "", err
	}
	for _, c := range istioHostProcCmds(d) {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			return "", fmt.Errorf("istio-cni's host proc: %s: %v: %s", strings.Join(c, " "), err, out)
		}
	}
	return d, nil
}

// istioHostProcCmds make d a proc mount whose 1/ns/net is the network
// namespace of whoever runs them.
func istioHostProcCmds(d string) [][]string {
	ns := filepath.Join(d, "1", "ns")
	return [][]string{
		{"mount", "-t", "proc", "proc", d},
		{"mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", ns},
		{"touch", filepath.Join(ns, "net")},
		{"mount", "--bind", "/proc/self/ns/net", filepath.Join(ns, "net")},
	}
}

// readyForIstioCNI gives the worker what istio-cni's pod mounts from the
// host at the first node's paths (istioPostRenderer): its run directory,
// and the host /proc view of istioHostProc, made in the worker's mount
// namespace with the worker's network as 1/ns/net. Both go with the
// worker's namespaces.
func (w *Worker) readyForIstioCNI(ctx context.Context, ic *IstioCNI) error {
	n := w.first
	rel, err := filepath.Rel(n.Dir, ic.RunDir)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(w.host(rel), 0o755); err != nil {
		return err
	}
	d := filepath.Join(n.Dir, "istio-host-proc")
	if err := os.MkdirAll(w.host("istio-host-proc"), 0o755); err != nil {
		return err
	}
	for _, c := range istioHostProcCmds(d) {
		if out, err := w.nsExec(ctx, c...); err != nil {
			return fmt.Errorf("istio-cni's host proc on %s: %s: %v: %s", w.Name, strings.Join(c, " "), err, out)
		}
	}
	return nil
}

// istioPostRenderer rewrites the host paths Istio's chart fixes (no value
// sets them) to the node's: istio-cni's run directory (mounted at the same
// path, which CNI_AGENT_RUN_DIR names), ztunnel's socket directory, the
// pod netns directory, mounted under /host at its own path as istio-cni
// opens "/host"+netns, and the host's /proc (istioHostProc).
func (n *Node) istioPostRenderer(ic *IstioCNI) (string, error) {
	proc, err := n.istioHostProc()
	if err != nil {
		return "", err
	}
	script := fmt.Sprintf(`#!/bin/sh
exec sed -e 's#^\( *\)path: /var/run/istio-cni$#\1path: %[1]s#' \
  -e 's#^\( *\)- mountPath: /var/run/istio-cni$#\1- mountPath: %[1]s#' \
  -e 's#^\( *\)path: /var/run/ztunnel$#\1path: %[2]s#' \
  -e 's#^\( *\)- mountPath: /host/var/run/netns$#\1- mountPath: /host%[3]s#' \
  -e 's#^\( *\)path: /proc$#\1path: %[4]s#'
`, ic.RunDir, n.ZtunnelSocketDir(), n.NetnsDir, proc)
	p := filepath.Join(n.Dir, "istio-post-render.sh")
	return p, os.WriteFile(p, []byte(script), 0o755)
}

// InstallIstioCNI runs helm install of Istio's istio-cni chart with
// values and waits until its DaemonSet is ready.
func (n *Node) InstallIstioCNI(ctx context.Context, ic *IstioCNI, values map[string]any) error {
	vf, err := n.writeValues("istio-cni-values.yaml", values)
	if err != nil {
		return err
	}
	pr, err := n.istioPostRenderer(ic)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(ic.RunDir, 0o755); err != nil {
		return err
	}
	if _, err = n.Helm(ctx, "install", IstioCNIRelease, ic.Chart, "--namespace", ReleaseNamespace, "-f", vf, "--post-renderer", pr, "--wait", "--timeout", "5m"); err != nil {
		return err
	}
	// helm's wait takes a DaemonSet of one node with maxUnavailable 1 as
	// ready at once: wait for the pod itself.
	return n.poll(ctx, "istio-cni's pod ready", n.opts.Wait, func(ctx context.Context) (bool, error) {
		pods, err := n.Client.CoreV1().Pods(ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=" + IstioCNIDaemonSet})
		if err != nil {
			return false, err
		}
		if len(pods.Items) != 1 {
			return false, fmt.Errorf("%d istio-cni pods", len(pods.Items))
		}
		p := &pods.Items[0]
		for _, c := range p.Status.Conditions {
			if p.DeletionTimestamp == nil && c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return true, nil
			}
		}
		return false, fmt.Errorf("istio-cni pod %s", podSummary(p))
	})
}

// UninstallIstioCNI runs helm uninstall of istio-cni.
func (n *Node) UninstallIstioCNI(ctx context.Context) error {
	_, err := n.Helm(ctx, "uninstall", IstioCNIRelease, "--namespace", ReleaseNamespace, "--wait", "--timeout", "5m")
	return err
}

// IstioCNIPods lists istio-cni's DaemonSet pods.
func (n *Node) IstioCNIPods(ctx context.Context) ([]string, error) {
	out, err := n.Client.CoreV1().Pods(ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "k8s-app=" + IstioCNIDaemonSet})
	if err != nil {
		return nil, err
	}
	var names []string
	for _, p := range out.Items {
		names = append(names, p.Name)
	}
	return names, nil
}

// istioHostNames are what istio-cni puts in the host's network namespace
// (its probe SNAT chain and ipsets, its nftables tables) and leaves there
// when it shuts down for an upgrade.
var (
	istioHostChains = []string{"ISTIO_POSTRT"}
	istioHostSets   = []string{"istio-inpod-probes-v4", "istio-inpod-probes-v6"}
)

// IstioHostState is what of istio-cni's is in the host netns.
type IstioHostState struct {
	Chains    map[string][]string // flavour: chains
	Sets      []string
	NftTables []string
}

// IstioHost returns istio-cni's objects in the host netns.
func IstioHost() (IstioHostState, error) {
	st := IstioHostState{Chains: map[string][]string{}}
	for _, f := range iptablesFlavours {
		save, err := iptablesSave(f)
		if err != nil {
			return st, err
		}
		for _, chains := range saveChains(save) {
			for _, c := range chains {
				if slices.Contains(istioHostChains, c) {
					st.Chains[f] = append(st.Chains[f], c)
				}
			}
		}
	}
	sets, err := ipsetNames()
	if err != nil {
		return st, err
	}
	for _, s := range sets {
		if slices.Contains(istioHostSets, s) {
			st.Sets = append(st.Sets, s)
		}
	}
	tables, err := nftTables()
	if err != nil {
		return st, err
	}
	for _, t := range tables {
		if strings.Contains(t, "istio") {
			st.NftTables = append(st.NftTables, t)
		}
	}
	return st, nil
}

// Sub is what s has that before had not.
func (s IstioHostState) Sub(before IstioHostState) IstioHostState {
	out := IstioHostState{Chains: map[string][]string{}}
	for f, cs := range s.Chains {
		for _, c := range cs {
			if !slices.Contains(before.Chains[f], c) {
				out.Chains[f] = append(out.Chains[f], c)
			}
		}
	}
	for _, x := range s.Sets {
		if !slices.Contains(before.Sets, x) {
			out.Sets = append(out.Sets, x)
		}
	}
	for _, x := range s.NftTables {
		if !slices.Contains(before.NftTables, x) {
			out.NftTables = append(out.NftTables, x)
		}
	}
	return out
}

// Empty reports whether nothing is listed.
func (s IstioHostState) Empty() bool {
	for _, cs := range s.Chains {
		if len(cs) > 0 {
			return false
		}
	}
	return len(s.Sets) == 0 && len(s.NftTables) == 0
}

func (s IstioHostState) String() string {
	var parts []string
	for f, cs := range s.Chains {
		for _, c := range cs {
			parts = append(parts, f+" chain "+c)
		}
	}
	for _, x := range s.Sets {
		parts = append(parts, "ipset "+x)
	}
	for _, x := range s.NftTables {
		parts = append(parts, "nft table "+x)
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// RemoveIstioHost removes what of istio-cni's the host holds beyond
// before: rules that jump to its chains go with them (tables first, as
// the sets are referenced from the rules).
func RemoveIstioHost(before IstioHostState) []error {
	now, err := IstioHost()
	if err != nil {
		return []error{err}
	}
	left := now.Sub(before)
	var errs []error
	for _, t := range left.NftTables {
		f := strings.Fields(t)
		if out, err := exec.Command("nft", "delete", "table", f[0], f[1]).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("nft delete table %s: %v: %s", t, err, out))
		}
	}
	for _, f := range iptablesFlavours {
		// istio-cni's chain is in nat.
		bc := map[string][]string{"nat": before.Chains[f]}
		errs = append(errs, removeChains(f, istioHostChains, bc)...)
	}
	for _, s := range left.Sets {
		if out, err := exec.Command("ipset", "destroy", s).CombinedOutput(); err != nil {
			errs = append(errs, fmt.Errorf("ipset destroy %s: %v: %s", s, err, out))
		}
	}
	return errs
}
