package realnode

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
)

// BuildCommand builds everything a real node needs.
const BuildCommand = "hack/kube-tools.sh node"

// Tools are the programs a node runs.
type Tools struct {
	Kubelet, ControllerManager, Scheduler, Helm, Crictl string
	// Kubectl is the real kubectl, to run the project's kubectl plugin
	// as operators do.
	Kubectl string
	// CNIPlugins is a directory with bridge, host-local and loopback.
	CNIPlugins string
	// Rootfs is the Debian base image tarball of the other images (Istio's
	// istio-cni).
	Rootfs string
	// ImageRootfs is make image's Debian base for this architecture
	// (image-rootfs-ARCH): the agent's image is built on it, so the node
	// runs the image make image builds.
	ImageRootfs string
	// Containerd and Ctr are containerd 2.x's, built into the tools cache
	// (its runc shim beside them); Runc is the Debian package's.
	Containerd, Ctr, Runc string
	// Registry is the CNCF distribution registry, the node's loopback
	// registry of the agent's image and the chart.
	Registry string
	// Repo is the repository root (images are built from it).
	Repo string
}

// FindTools locates every program, naming the command that builds or
// installs whatever is missing.
func FindTools() (Tools, error) {
	var t Tools
	var err error
	if t.Repo, err = kubeenv.RepoRoot(); err != nil {
		return t, err
	}
	var missing []string
	for _, n := range []string{kubeenv.Etcd, kubeenv.KubeAPIServer} {
		if _, err := kubeenv.ToolPath(n); err != nil {
			missing = append(missing, n)
		}
	}
	for name, dst := range map[string]*string{
		"kubelet": &t.Kubelet, "kube-controller-manager": &t.ControllerManager, "kube-scheduler": &t.Scheduler,
		"helm": &t.Helm, "crictl": &t.Crictl, "kubectl": &t.Kubectl, "cni-plugins": &t.CNIPlugins, "debian-rootfs": &t.Rootfs,
		"containerd": &t.Containerd, "registry": &t.Registry, "image-rootfs-" + runtime.GOARCH: &t.ImageRootfs,
	} {
		p, err := toolPath(t.Repo, name)
		if err != nil {
			missing = append(missing, name)
			continue
		}
		*dst = p
	}
	if t.Containerd != "" {
		// The containerd tool is a directory of containerd, its shim and ctr.
		dir := t.Containerd
		t.Containerd, t.Ctr = filepath.Join(dir, "containerd"), filepath.Join(dir, "ctr")
	}
	var pkgs []string
	for name, dst := range map[string]*string{"runc": &t.Runc, "mmdebstrap": new(string), "nft": new(string), "ipset": new(string), "iptables": new(string)} {
		p, err := exec.LookPath(name)
		if err != nil {
			pkgs = append(pkgs, name)
			continue
		}
		*dst = p
	}
	var errs []error
	if len(missing) > 0 {
		errs = append(errs, fmt.Errorf("not built: %s; build them with %s (minutes the first time, then cached)", strings.Join(missing, ", "), BuildCommand))
	}
	if len(pkgs) > 0 {
		errs = append(errs, fmt.Errorf("not installed: %s (Debian packages runc, mmdebstrap, nftables, ipset, iptables; make deps installs them)", strings.Join(pkgs, ", ")))
	}
	return t, errors.Join(errs...)
}

// toolPath asks hack/kube-tools.sh where it caches a tool (the one place
// that knows versions and cache keys), waiting for it while a running
// kube-tools.sh builds it (kubeenv.AwaitTool); AMBIENT_TOOL_<NAME>
// overrides it.
func toolPath(repo, name string) (string, error) {
	if p := os.Getenv("AMBIENT_TOOL_" + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))); p != "" {
		return p, statTool(p)
	}
	out, err := exec.Command("bash", filepath.Join(repo, "hack", "kube-tools.sh"), "--path", name).Output()
	if err != nil {
		return "", fmt.Errorf("kube-tools.sh --path %s: %w", name, err)
	}
	p := strings.TrimSpace(string(out))
	// The name the builder lists: the path's (istiod stands for istiod-MINOR).
	kubeenv.AwaitTool(filepath.Base(p), p, func(format string, args ...any) { fmt.Fprintf(os.Stderr, "realnode: "+format+"\n", args...) })
	return p, statTool(p)
}

// RecentRunc is the runc built into the tools cache (hack/kube-tools.sh
// runc): unlike Debian's 1.1.5 it makes idmapped mounts, which containerd
// 2.x requires of a runtime before it reports user namespace support.
func RecentRunc() (string, error) {
	repo, err := kubeenv.RepoRoot()
	if err != nil {
		return "", err
	}
	return toolPath(repo, "runc")
}

func statTool(p string) error {
	if _, err := os.Stat(p); err != nil {
		return fmt.Errorf("%s: %w", p, err)
	}
	return nil
}

// lockPath is the machine-wide lock of real nodes: kubelet's cgroups and
// iptables chains are the host's, so two nodes would fight over them. It
// lives in the machine's /run/lock, not in the tools cache: two checkouts
// with caches of their own (a cold CI run beside a developer's tests) share
// the machine, so they must share the lock too. A chroot that runs real
// nodes binds the host's /run/lock (hack/freshroot.sh).
func lockPath() (string, error) {
	const dir = "/run/lock"
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("real-node lock directory: %w", err)
	}
	return filepath.Join(dir, "ambient-cni-realnode.lock"), nil
}

func acquireLock(ctx context.Context, logf func(string, ...any)) (*os.File, error) {
	p, err := lockPath()
	if err != nil {
		return nil, err
	}
	f, err := os.OpenFile(p, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	told := false
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			_ = f.Close()
			return nil, fmt.Errorf("lock %s: %w", p, err)
		}
		if !told {
			logf("   another real node runs on this machine; waiting for it to finish")
			told = true
		}
		select {
		case <-ctx.Done():
			_ = f.Close()
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

func releaseLock(f *os.File) {
	_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
	_ = f.Close()
}
