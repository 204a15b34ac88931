package deploy

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// kubeVersion is the oldest Kubernetes the chart's objects are valid on:
// 1.30, where the DaemonSet's securityContext.appArmorProfile (rendered
// by default) and ValidatingAdmissionPolicy v1 (startupTaint) are GA.
// helm refuses older clusters instead of the API server dropping the
// AppArmor field or rejecting the policy.
func TestChartKubeVersion(t *testing.T) {
	if _, err := helm(t, "template", releaseName, chartDir, "--kube-version", "1.29.9"); err == nil || !strings.Contains(err.Error(), "kubeVersion") {
		t.Errorf("helm template for Kubernetes 1.29: %v, want refused by kubeVersion", err)
	}
	out, err := helm(t, "template", releaseName, chartDir, "--kube-version", "1.30.0", "--set", "startupTaint.enabled=true")
	if err != nil {
		t.Fatalf("helm template for Kubernetes 1.30: %v", err)
	}
	for _, want := range []string{"appArmorProfile:", "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\n"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("the chart no longer renders %q: kubeVersion may go lower (see Chart.yaml)", want)
		}
	}
	if _, err := helm(t, "template", releaseName, chartDir, "--kube-version", "1.30.4-gke.1200"); err != nil {
		t.Errorf("helm template for a provider's 1.30 (pre-release form): %v", err)
	}
}

// make chart's package carries the version and appVersion it was given,
// and the image it deploys is tagged with that appVersion.
func TestChartPackage(t *testing.T) {
	dir := t.TempDir()
	if _, err := helm(t, "package", chartDir, "--version", "1.2.3-rc.1", "--app-version", "v1.2.3-rc.1", "-d", dir); err != nil {
		t.Fatal(err)
	}
	tgz := filepath.Join(dir, "ambient-cni-1.2.3-rc.1.tgz")
	if _, err := os.Stat(tgz); err != nil {
		t.Fatal(err)
	}
	out, err := helm(t, "show", "chart", tgz)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"version: 1.2.3-rc.1\n", "appVersion: v1.2.3-rc.1\n", "kubeVersion: '>=1.30.0-0'\n"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("packaged Chart.yaml lacks %q:\n%s", want, out)
		}
	}
	m, err := helm(t, "template", releaseName, tgz, "--namespace", namespace)
	if err != nil {
		t.Fatal(err)
	}
	if img := decode(t, m).container(t).Image; !strings.HasSuffix(img, ":v1.2.3-rc.1") {
		t.Errorf("packaged chart deploys image %s, want the tag v1.2.3-rc.1 (appVersion)", img)
	}
}

// The VERSION file is the one source of a release's version: the source
// tree's chart (and so deploy/manifests' labels and image tag) carries
// the same, as version and appVersion.
func TestChartVersionIsVersionFile(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(repoRoot(t), "VERSION"))
	if err != nil {
		t.Fatalf("%v: the VERSION file holds the version a release carries", err)
	}
	v := strings.TrimSpace(string(b))
	out, err := helm(t, "show", "chart", chartDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"\nversion: " + v + "\n", "\nappVersion: " + v + "\n"} {
		if !strings.Contains("\n"+string(out), want) {
			t.Errorf("Chart.yaml lacks %q: set its version and appVersion to the VERSION file's %s (then make manifests)", strings.TrimSpace(want), v)
		}
	}
}
