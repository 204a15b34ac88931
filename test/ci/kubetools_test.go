package ci

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// fakeGo stands in for go: it logs each call ("DIR: ARGS") to
// FAKE_GO_LOG, answers go env GOARCH, names FAKE_MOD_DIR as any module's
// download, and go build sleeps FAKE_GO_SLEEP seconds, then writes each
// package's binary (-o DIR/) or the one named.
const fakeGo = `#!/usr/bin/env bash
echo "$PWD: $*" >>"$FAKE_GO_LOG"
case "$1" in
env) echo amd64 ;;
mod) [[ "$2" != download ]] || printf '{\n\t"Dir": "%s"\n}\n' "$FAKE_MOD_DIR" ;;
build)
	out="" prev="" pkgs=()
	for a in "$@"; do
		[[ "$prev" != -o ]] || out=$a
		case "$a" in k8s.io/* | github.com/* | helm.sh/* | istio.io/* | .) pkgs+=("$a") ;; esac
		prev=$a
	done
	sleep "${FAKE_GO_SLEEP:-0}"
	if [[ "$out" == */ ]]; then
		mkdir -p "$out"
		for p in "${pkgs[@]}"; do echo bin >"$out/${p##*/}"; done
	else
		echo bin >"$out"
	fi
	;;
esac
`

// kubeTools runs hack/kube-tools.sh ARGS... with the fake go on the tools
// cache dir and returns its output and the go builds it ran.
func kubeTools(t *testing.T, cache string, env []string, args ...string) (string, []string) {
	t.Helper()
	dir := t.TempDir()
	log := filepath.Join(dir, "go.log")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", append([]string{script(t, "kube-tools.sh")}, args...)...)
	cmd.Env = append(os.Environ(), append(env, "GO="+writeExe(t, dir, "go", fakeGo), "FAKE_GO_LOG="+log, "AMBIENT_TOOLS_CACHE="+cache)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("kube-tools.sh %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	calls, err := os.ReadFile(log)
	if err != nil {
		t.Fatal(err)
	}
	var builds []string
	for l := range strings.SplitSeq(string(calls), "\n") {
		if strings.Contains(l, ": build ") {
			builds = append(builds, l)
		}
	}
	return string(out), builds
}

func TestKubeToolsOneGoBuildForKubernetes(t *testing.T) {
	cache := t.TempDir()
	// kubelet is cached already: not rebuilt, and not in the go build.
	kubelet := filepath.Join(cache, "kubelet-v1.37.2", "kubelet")
	if err := os.MkdirAll(filepath.Dir(kubelet), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(kubelet, []byte("cached"), 0o755); err != nil {
		t.Fatal(err)
	}
	out, builds := kubeTools(t, cache, nil, "kubectl", "etcd", "kubelet", "kube-apiserver", "kube-scheduler")
	var kube []string
	for _, b := range builds {
		if strings.Contains(b, "/hack/tools/kubernetes: ") {
			kube = append(kube, b)
		}
	}
	if len(kube) != 1 {
		t.Fatalf("want one go build of the Kubernetes binaries, got %d:\n%s", len(kube), strings.Join(builds, "\n"))
	}
	for _, cmd := range []string{"kube-apiserver", "kube-scheduler", "kubectl"} {
		if !strings.Contains(kube[0], "k8s.io/kubernetes/cmd/"+cmd) {
			t.Errorf("the go build lacks %s: %s", cmd, kube[0])
		}
		p := filepath.Join(cache, cmd+"-v1.37.2", cmd)
		if b, err := os.ReadFile(p); err != nil || string(b) != "bin\n" {
			t.Errorf("%s: %q, %v", p, b, err)
		}
	}
	if strings.Contains(kube[0], "cmd/kubelet") {
		t.Errorf("the cached kubelet was rebuilt: %s", kube[0])
	}
	if !strings.Contains(out, "kubelet v1.37.2 cached at") {
		t.Errorf("no line says kubelet is cached:\n%s", out)
	}
	if b, _ := os.ReadFile(kubelet); string(b) != "cached" {
		t.Errorf("the cached kubelet was replaced: %q", b)
	}
	// Everything cached: no build at all.
	if _, again := kubeTools(t, cache, nil, "kubectl", "etcd", "kubelet", "kube-apiserver", "kube-scheduler"); len(again) != 0 {
		t.Errorf("a warm cache rebuilt:\n%s", strings.Join(again, "\n"))
	}
}

// istiod builds before Istio's istio-cni, whatever the order asked (make
// check's node-tools asks for both): the real node needs istiod first, and
// istio-cni's build then finds most of their common packages compiled.
// (next, built from the module proxy, which the fake go answers; a
// released minor's order is the same list's.)
func TestKubeToolsIstiodBeforeIstioCNI(t *testing.T) {
	cache, src := t.TempDir(), t.TempDir()
	for _, f := range []string{"VERSION", "manifests/charts/base/files/crd-all.gen.yaml", "manifests/charts/istio-control/istio-discovery/Chart.yaml", "manifests/charts/istio-cni/Chart.yaml"} {
		p := filepath.Join(src, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte("1.32.0\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	_, builds := kubeTools(t, cache, []string{"FAKE_MOD_DIR=" + src}, "istio-cni-next", "istiod-next")
	istiod, cni := -1, -1
	for i, b := range builds {
		switch {
		case strings.Contains(b, "istio.io/istio/pilot/cmd/pilot-discovery"):
			istiod = i
		case strings.Contains(b, "istio.io/istio/cni/cmd/install-cni"):
			cni = i
		}
	}
	if istiod < 0 || cni < 0 || istiod > cni {
		t.Fatalf("want istiod's go build, then istio-cni's; got:\n%s", strings.Join(builds, "\n"))
	}
}

// istiod and istio-cni stand for the default minor's, a released one,
// whose source is the archive of its tag: looked up where ISTIO_SOURCES
// says, checked against the sha256 hack/tools/istio-MINOR/source records;
// a missing or altered archive stops the build with a line saying so.
func TestKubeToolsIstioReleaseSource(t *testing.T) {
	out, err := exec.Command("bash", script(t, "kube-tools.sh"), "--path", "istiod").Output()
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`/istiod-1\.[0-9]+-1\.[0-9]+\.[0-9]+[^/]*/istiod-1\.[0-9]+\n$`).Match(out) {
		t.Errorf("--path istiod = %q, want a released minor's istiod-1.N", out)
	}
	empty := t.TempDir()
	for name, c := range map[string]struct {
		archive []byte
		want    string
	}{
		"missing": {want: "source archive istio-1."},
		"altered": {archive: []byte("not Istio"), want: "has sha256 "},
	} {
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			if c.archive != nil {
				minors, err := exec.Command("bash", script(t, "kube-tools.sh"), "--istio-minors").Output()
				if err != nil {
					t.Fatal(err)
				}
				src, err := os.ReadFile(filepath.Join(filepath.Dir(script(t, "kube-tools.sh")), "tools", "istio-"+strings.Fields(string(minors))[0], "source"))
				if err != nil {
					t.Fatal(err)
				}
				archive := regexp.MustCompile(`(?m)^archive=(\S+)$`).FindSubmatch(src)
				if archive == nil {
					t.Fatalf("no archive= in %s", src)
				}
				if err := os.WriteFile(filepath.Join(dir, string(archive[1])), c.archive, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			cmd := exec.Command("bash", script(t, "kube-tools.sh"), "istiod")
			bin := t.TempDir()
			cmd.Env = append(os.Environ(), "ISTIO_SOURCES="+dir, "AMBIENT_TOOLS_CACHE="+empty,
				"GO="+writeExe(t, bin, "go", fakeGo), "FAKE_GO_LOG="+filepath.Join(bin, "go.log"))
			out, err := cmd.CombinedOutput()
			if err == nil || !strings.Contains(string(out), c.want) {
				t.Errorf("kube-tools.sh istiod with ISTIO_SOURCES holding %q: %v, want a failure saying %q:\n%s", c.archive, err, c.want, out)
			}
			if left, _ := filepath.Glob(filepath.Join(empty, "istiod-*", "istiod-*")); len(left) != 0 {
				t.Errorf("a failed build left %v", left)
			}
		})
	}
}

func TestKubeToolsProgressWithEstimate(t *testing.T) {
	cache := t.TempDir()
	env := []string{"KUBE_TOOLS_HEARTBEAT=1", "FAKE_GO_SLEEP=4"}
	out, _ := kubeTools(t, cache, env, "kube-apiserver", "kubelet")
	// Nothing built before: the estimate is the committed table's (cold,
	// 2 cores): 380 s and 120 s, 9 minutes in all.
	progress := regexp.MustCompile(`(?m)^kube-tools: 0 of 2 tools built, about [89] min left; building kube-apiserver\+kubelet \d+:\d\d of about 8:20$`)
	if !progress.MatchString(out) {
		t.Fatalf("no progress line with the estimate:\n%s", out)
	}
	// The build's time is recorded beside each binary, and the next
	// build of another version estimates from it rather than the table.
	secs, err := os.ReadFile(filepath.Join(cache, "kube-apiserver-v1.37.2", ".seconds"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`^\d+\n$`).Match(secs) {
		t.Fatalf(".seconds holds %q", secs)
	}
	if err := os.Rename(filepath.Join(cache, "kube-apiserver-v1.37.2"), filepath.Join(cache, "kube-apiserver-v1.36.0")); err != nil {
		t.Fatal(err)
	}
	out, _ = kubeTools(t, cache, env, "kube-apiserver")
	want := regexp.MustCompile(`(?m)^kube-tools: building kube-apiserver v1\.37\.2 \(about 0:\d\d on 2 cores\)`)
	if !want.MatchString(out) {
		t.Errorf("the estimate is not the recorded build's:\n%s", out)
	}
}
