package realnode

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/pkg/atomicfile"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// Layout is how the node's runtime finds its CNI plugins and configs, as
// a platform lays them out (Options.Layout). The platform's directories
// come from the chart's own profile (files/platforms.yaml) and are
// mirrored under the node directory (HostRoot), so the node never writes
// the machine's real paths while containerd, the chart and the agent all
// see the platform's shape.
type Layout string

const (
	// LayoutGeneric is /opt/cni/bin and /etc/cni/net.d style dirs in the
	// node directory, as before layouts existed (no platform value).
	LayoutGeneric Layout = ""
	// LayoutGKE is GKE's: plugins in /home/kubernetes/bin.
	LayoutGKE Layout = "gke"
	// LayoutK3s is k3s's: configs under its agent dir, plugins under its
	// data dir.
	LayoutK3s Layout = "k3s"
	// LayoutMultus is OpenShift's: Multus (the real thin plugin) is the
	// runtime's primary config (00-multus.conf, first in CRI-O's conf dir
	// /etc/kubernetes/cni/net.d), delegating the cluster network to the
	// bridge + host-local conflist in /run/multus/cni/net.d, where
	// OpenShift's network plugin writes its own.
	LayoutMultus Layout = "multus"
)

// MultusConfName is Multus's own config in the runtime's conf dir, the
// name Multus's installers give it.
const MultusConfName = "00-multus.conf"

// Platform is the chart's platform value for the layout.
func (l Layout) Platform() string {
	if l == LayoutMultus {
		return "openshift"
	}
	return string(l)
}

// HostRoot is the directory that stands for the host's / in the layout's
// paths.
func (n *Node) HostRoot() string { return filepath.Join(n.Dir, "host") }

// MultusDelegateDir is where the cluster network's conflist lives under
// LayoutMultus (Multus's clusterNetwork); empty under other layouts.
func (n *Node) MultusDelegateDir() string {
	if n.opts.Layout != LayoutMultus {
		return ""
	}
	return filepath.Join(n.HostRoot(), "run", "multus", "cni", "net.d")
}

// ConfDirs are the directories holding the node's CNI configs: the
// runtime's conf dir and, under Multus, the delegate's.
func (n *Node) ConfDirs() []string {
	if d := n.MultusDelegateDir(); d != "" {
		return []string{n.CNIConfDir, d}
	}
	return []string{n.CNIConfDir}
}

// layoutDirs sets CNIBinDir and CNIConfDir for the layout and returns the
// directory the bridge + host-local conflist goes to.
func (n *Node) layoutDirs() (primaryDir string, err error) {
	if n.opts.Layout == LayoutGeneric {
		n.CNIBinDir = filepath.Join(n.Dir, "cni", "bin")
		n.CNIConfDir = filepath.Join(n.Dir, "cni", "net.d")
		return n.CNIConfDir, nil
	}
	bin, conf, err := profileDirs(n.Tools.Repo, n.opts.Layout.Platform())
	if err != nil {
		return "", err
	}
	n.CNIBinDir = filepath.Join(n.HostRoot(), bin)
	n.CNIConfDir = filepath.Join(n.HostRoot(), conf)
	if d := n.MultusDelegateDir(); d != "" {
		return d, os.MkdirAll(d, 0o755)
	}
	return n.CNIConfDir, nil
}

// profileDirs reads a platform's bin and conf dirs from the chart's
// profile, generic's where the platform sets none.
func profileDirs(repo, platform string) (bin, conf string, err error) {
	b, err := os.ReadFile(filepath.Join(repo, ChartDir, "files", "platforms.yaml"))
	if err != nil {
		return "", "", err
	}
	var all map[string]struct {
		BinDir  string `json:"binDir"`
		ConfDir string `json:"confDir"`
	}
	if err := yaml.Unmarshal(b, &all); err != nil {
		return "", "", fmt.Errorf("chart platforms: %w", err)
	}
	p, ok := all[platform]
	if !ok {
		return "", "", fmt.Errorf("platform %q is not in the chart's platforms", platform)
	}
	bin, conf = all["generic"].BinDir, all["generic"].ConfDir
	if p.BinDir != "" {
		bin = p.BinDir
	}
	if p.ConfDir != "" {
		conf = p.ConfDir
	}
	if bin == "" || conf == "" {
		return "", "", fmt.Errorf("platform %q: no bin or conf dir in the chart's platforms", platform)
	}
	return bin, conf, nil
}

// multusKubeconfig is Multus's kubeconfig, in the conf dir's multus.d as
// Multus's installers put it.
func (n *Node) multusKubeconfig() string {
	return filepath.Join(n.CNIConfDir, "multus.d", "multus.kubeconfig")
}

// writeMultus installs the Multus thin plugin and makes it the runtime's
// primary config, delegating the cluster network to the conflist at
// delegate. Everything Multus keeps (its cache, its configs by name, its
// log) is in the node directory.
func (n *Node) writeMultus(delegate string) error {
	bin, err := toolPath(n.Tools.Repo, "multus")
	if err != nil {
		return fmt.Errorf("%w; build it with hack/kube-tools.sh multus", err)
	}
	if err := atomicfile.CopyFile(bin, filepath.Join(n.CNIBinDir, "multus"), atomicfile.Options{Mode: 0o755}); err != nil {
		return fmt.Errorf("install multus: %w", err)
	}
	m := filepath.Join(n.Dir, "multus")
	for _, d := range []string{filepath.Join(m, "cache"), filepath.Join(m, "net.d"), filepath.Dir(n.multusKubeconfig())} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	conf := map[string]any{
		// What Multus's installers write: an old single-plugin .conf.
		"cniVersion":     "0.3.1",
		"name":           "multus-cni-network",
		"type":           "multus",
		"clusterNetwork": delegate,
		"kubeconfig":     n.multusKubeconfig(),
		"binDir":         n.CNIBinDir,
		"cniDir":         filepath.Join(m, "cache"),
		"confDir":        filepath.Join(m, "net.d"),
		"logFile":        filepath.Join(n.Dir, "multus.log"),
		"logLevel":       "verbose",
	}
	b, err := json.MarshalIndent(conf, "", "  ")
	if err != nil {
		return err
	}
	n.CNIConfFile = filepath.Join(n.CNIConfDir, MultusConfName)
	n.CNIConfOriginal = append(b, '\n')
	return os.WriteFile(n.CNIConfFile, n.CNIConfOriginal, 0o644)
}

// writeLayoutKubeconfig gives Multus its kubeconfig once the API server
// runs: the node's own, on loopback.
func (n *Node) writeLayoutKubeconfig() error {
	if n.opts.Layout != LayoutMultus {
		return nil
	}
	return kubeenv.WriteKubeconfig(n.Kube.Config, n.multusKubeconfig())
}
