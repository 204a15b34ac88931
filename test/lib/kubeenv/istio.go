package kubeenv

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Istio's builds: hack/kube-tools.sh builds istiod-MINOR and
// istio-cni-MINOR for each minor it lists (--istio-minors: released
// minors from the source of their tag, and "next", istio.io/istio's
// master); the names istiod and istio-cni stand for its default minor,
// the one make check runs.

// IstioEnv names the minor the tests run (make e2e-matrix sets it);
// unset, they run the default.
const IstioEnv = "AMBIENT_ISTIO"

// IstioTool is the tools-cache name of base ("istiod" or "istio-cni")
// for the Istio the tests run: base-MINOR when IstioEnv names a minor,
// else base, which hack/kube-tools.sh resolves to the default minor's.
func IstioTool(base string) string {
	if m := os.Getenv(IstioEnv); m != "" {
		return base + "-" + m
	}
	return base
}

// IstioMinor is the minor the tests run: IstioEnv's, else the default.
func IstioMinor() (string, error) {
	if m := os.Getenv(IstioEnv); m != "" {
		return m, nil
	}
	ms, err := IstioMinors()
	if err != nil {
		return "", err
	}
	if len(ms) == 0 {
		return "", fmt.Errorf("hack/kube-tools.sh --istio-minors lists no minor")
	}
	return ms[0], nil
}

// IstioMinors lists the minors hack/kube-tools.sh builds, the default
// first.
func IstioMinors() ([]string, error) {
	out, err := kubeTools("--istio-minors")
	if err != nil {
		return nil, err
	}
	return strings.Fields(out), nil
}

// IstioSource returns the source tree of a minor's Istio (its charts are
// under manifests/charts), unpacking a released minor's archive into the
// tools cache the first time.
func IstioSource(minor string) (string, error) {
	return kubeTools("--istio-src", minor)
}

// IstioVersion is the version a built Istio tool directory holds, read
// from its name in the cache: <cache>/<name>-<version>/<name>.
func IstioVersion(toolDir string) string {
	name := filepath.Base(toolDir)
	return strings.TrimPrefix(filepath.Base(filepath.Dir(toolDir)), name+"-")
}

func kubeTools(args ...string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.Command("bash", append([]string{filepath.Join(root, "hack", "kube-tools.sh")}, args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("hack/kube-tools.sh %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(stderr.Bytes()))
	}
	return strings.TrimSpace(string(out)), nil
}
