// Package release tests make release as a maintainer runs it: in a clean
// copy of the source tree committed as a release commit (the VERSION
// file and CHANGELOG's section set), the whole release built twice from
// two copies and compared byte for byte, and the ways it refuses to start.
package release

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"debug/elf"
	"debug/macho"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// The release the tests cut, and the registry the refusals name (they
// push nothing; TestReleaseReproducible pushes to a loopback registry).
const (
	testVersion  = "0.0.1-test"
	testRegistry = "registry.invalid:5000/ambient-test"
	testSection  = "## [" + testVersion + "] - 2026-12-06"
)

// sourceTree copies the repository's files (tracked, and untracked but
// not ignored: the change under test) to a new directory, sets the
// VERSION file to version and turns CHANGELOG's Unreleased into the
// version's section, writes the extra files (path: content), and commits
// it all with fixed names and times, so two copies are one commit.
func sourceTree(t *testing.T, version string, extra map[string]string) string {
	t.Helper()
	root, err := kubeenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard").Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	dst := filepath.Join(t.TempDir(), "src")
	for name := range strings.SplitSeq(strings.TrimSuffix(string(out), "\x00"), "\x00") {
		src := filepath.Join(root, name)
		fi, err := os.Lstat(src)
		if os.IsNotExist(err) {
			continue // deleted, not yet committed
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dst, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, b, fi.Mode().Perm()); err != nil {
			t.Fatal(err)
		}
	}
	write(t, filepath.Join(dst, "VERSION"), version+"\n")
	cl := read(t, filepath.Join(dst, "CHANGELOG.md"))
	if !strings.Contains(cl, "\n## Unreleased\n") {
		t.Fatal("CHANGELOG.md has no \"## Unreleased\" section to cut")
	}
	write(t, filepath.Join(dst, "CHANGELOG.md"), strings.Replace(cl, "\n## Unreleased\n", "\n"+testSection+"\n", 1))
	for name, content := range extra {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dst, name)), 0o755); err != nil {
			t.Fatal(err)
		}
		write(t, filepath.Join(dst, name), content)
	}
	git(t, dst, "init", "-q")
	git(t, dst, "add", "-A")
	git(t, dst, "commit", "-q", "-m", "release "+version)
	return dst
}

func git(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command("git", append([]string{"-c", "user.name=release-test", "-c", "user.email=release-test@example.invalid", "-c", "commit.gpgsign=false"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GIT_AUTHOR_DATE=@1765000000 +0000", "GIT_COMMITTER_DATE=@1765000000 +0000")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

func read(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func write(t *testing.T, p, s string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(s), 0o644); err != nil {
		t.Fatal(err)
	}
}

// makeRelease runs make in dir with args, none of the caller's make
// variables leaking in, and returns its output and error.
func makeRelease(t *testing.T, dir string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("make", append([]string{"--no-print-directory"}, args...)...)
	cmd.Dir = dir
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VERSION", "REGISTRY", "RELEASE_DIR", "BIN", "SOURCE_DATE_EPOCH", "COMMIT", "SIGNING_KEY", "RELEASE_PUBKEY", "IMAGE_ARCHES", "PLUGIN_PLATFORMS":
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// make release refuses, before building anything, a tree with changes, a
// VERSION= that is not the VERSION file's, no REGISTRY, and a version
// CHANGELOG has no section of: each with a message that says what to do.
func TestReleaseRefuses(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		testnet.Missing(t, "needs make")
	}
	dir := sourceTree(t, testVersion, nil)
	reg := "REGISTRY=" + testRegistry
	steps := []struct {
		name   string
		change func()
		args   []string
		want   string
	}{
		{"untracked file", func() { write(t, filepath.Join(dir, "stray.go"), "package stray\n") }, []string{"release", reg}, "the tree is not clean"},
		{"changed file", func() {
			os.Remove(filepath.Join(dir, "stray.go"))
			write(t, filepath.Join(dir, "README.md"), read(t, filepath.Join(dir, "README.md"))+"\nmore\n")
		}, []string{"release", reg}, "the tree is not clean"},
		{"VERSION= not the file's", func() { git(t, dir, "checkout", "-q", "--", "README.md") }, []string{"release", "VERSION=9.9.9", reg}, "but the VERSION file says " + testVersion},
		{"no REGISTRY", func() {}, []string{"release", "VERSION=" + testVersion}, "REGISTRY=host[:port]/path is needed"},
		{"no CHANGELOG section", func() {
			write(t, filepath.Join(dir, "VERSION"), "0.0.2\n")
			git(t, dir, "commit", "-q", "-a", "-m", "0.0.2")
		}, []string{"release", reg}, `CHANGELOG.md has no section "## [0.0.2]"`},
		{"not SemVer", func() {
			write(t, filepath.Join(dir, "VERSION"), "v0.0.2\n")
			git(t, dir, "commit", "-q", "-a", "-m", "v0.0.2")
		}, []string{"release", reg}, "is not SemVer"},
		{"release-push without SIGNING_KEY", func() {}, []string{"release-push", reg}, "SIGNING_KEY=path is needed"},
	}
	for _, s := range steps {
		s.change()
		out, err := makeRelease(t, dir, s.args...)
		if err == nil || !strings.Contains(out, s.want) {
			t.Errorf("%s: make %s: %v, want refused with %q:\n%s", s.name, strings.Join(s.args, " "), err, s.want, out)
		}
		if _, err := os.Stat(filepath.Join(dir, "bin", "release")); !os.IsNotExist(err) {
			t.Fatalf("%s: make release wrote bin/release before refusing (%v)", s.name, err)
		}
	}
}

// files returns every regular file under dir by its slash path.
func files(t *testing.T, dir string) map[string][]byte {
	t.Helper()
	m := map[string][]byte{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		b, err := os.ReadFile(p)
		m[filepath.ToSlash(rel)] = b
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func sum(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }

// TestReleaseReproducible runs make release twice, from two copies of the
// tree at different paths, and checks the two release directories are
// the same byte for byte; then that the release is what it says: the
// manifest names the image index by its digest (the same objects as the
// source tree's manifest otherwise), the chart defaults to that image,
// SHA256SUMS holds every file's sum, the krew manifest the archives'
// sums, each archive the plugin for its platform stamped with the
// version; then make release-push to a loopback registry, from which the
// chart pulls and renders as the release's (checkPush). It builds
// everything twice (the image for two architectures, the plugin for four
// platforms: minutes), so it runs with AMBIENT_TEST_RELEASE=1 (make
// test-release, outside make check: CI's time).
func TestReleaseReproducible(t *testing.T) {
	if os.Getenv("AMBIENT_TEST_RELEASE") == "" {
		t.Skip("builds two whole releases (minutes); AMBIENT_TEST_RELEASE=1 runs it (make test-release)")
	}
	if _, err := exec.LookPath("make"); err != nil {
		testnet.Missing(t, "needs make")
	}
	registry := startRegistry(t) + "/ambient-test"
	key, pub := releaseKey(t)
	var rel [2]map[string][]byte
	var dirs, srcs [2]string
	for i := range rel {
		src := sourceTree(t, testVersion, map[string]string{releasePubKey: pub})
		out, err := makeRelease(t, src, "release", "VERSION="+testVersion, "REGISTRY="+registry)
		if err != nil {
			t.Fatalf("make release (run %d): %v\n%s", i+1, err, out)
		}
		srcs[i] = src
		dirs[i] = filepath.Join(src, "bin", "release", testVersion)
		rel[i] = files(t, dirs[i])
		if _, err := os.Stat(dirs[i] + ".work"); !os.IsNotExist(err) {
			t.Errorf("run %d left its work directory (%v)", i+1, err)
		}
	}
	a, b := rel[0], rel[1]
	names := slices.Sorted(func(yield func(string) bool) {
		for n := range a {
			if !yield(n) {
				return
			}
		}
	})
	for _, n := range names {
		if _, ok := b[n]; !ok {
			t.Errorf("%s: only in the first release", n)
		} else if !bytes.Equal(a[n], b[n]) {
			t.Errorf("%s differs: sha256 %s and %s", n, sum(a[n]), sum(b[n]))
		}
	}
	for n := range b {
		if _, ok := a[n]; !ok {
			t.Errorf("%s: only in the second release", n)
		}
	}
	for _, n := range names {
		if !strings.HasPrefix(n, "image/blobs/") {
			t.Logf("%s  %s (both runs)", sum(a[n]), n)
		}
	}

	// The image index, both architectures, and its digest.
	idx, err := ociimage.ReadLayout(filepath.Join(dirs[0], "image"))
	if err != nil {
		t.Fatal(err)
	}
	digest, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	var arches []string
	for _, m := range im.Manifests {
		arches = append(arches, m.Platform.OS+"/"+m.Platform.Architecture)
	}
	if slices.Sort(arches); !slices.Equal(arches, []string{"linux/amd64", "linux/arm64"}) {
		t.Errorf("the index holds %v, want linux/amd64 and linux/arm64", arches)
	}
	image := registry + "/ambient-cni@" + digest.String()
	t.Logf("image index %s, the same in both runs", image)

	checkManifest(t, string(a["ambient-cni.yaml"]), image)
	checkChart(t, a["ambient-cni-"+testVersion+".tgz"], registry, digest.String())
	checkSums(t, a)
	checkKrew(t, a)
	notes := string(a["RELEASE_NOTES.md"])
	for _, want := range []string{"# ambient-cni " + testVersion + "\n", image, "oci://" + registry + "/charts/ambient-cni"} {
		if !strings.Contains(notes, want) {
			t.Errorf("RELEASE_NOTES.md lacks %q", want)
		}
	}
	root, _ := kubeenv.RepoRoot()
	cl := read(t, filepath.Join(root, "CHANGELOG.md"))
	section, _, _ := strings.Cut(cl[strings.Index(cl, "\n## Unreleased\n")+len("\n## Unreleased\n"):], "\n## ")
	if !strings.Contains(notes, strings.TrimSpace(section)) {
		t.Error("RELEASE_NOTES.md does not hold CHANGELOG's section")
	}

	checkSBOM(t, a["sbom.spdx.json"], filepath.Join(dirs[0], "image"))
	checkPush(t, srcs[0], registry, key, digest.String(), a)
}

// startRegistry runs the CNCF distribution registry (make node-tools
// builds it) on loopback, plain HTTP, storage in a temporary directory,
// and returns its host:port.
func startRegistry(t *testing.T) string {
	t.Helper()
	root, err := kubeenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(filepath.Join(root, "hack", "kube-tools.sh"), "--path", "registry").Output()
	bin := strings.TrimSpace(string(out))
	if err != nil || bin == "" {
		testnet.Missing(t, "the registry is not built: make node-tools")
	}
	if _, err := os.Stat(bin); err != nil {
		testnet.Missing(t, "the registry is not built ("+err.Error()+"): make node-tools")
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yml")
	write(t, cfg, fmt.Sprintf("version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: %q\nhttp:\n  addr: %q\n", filepath.Join(dir, "storage"), addr))
	p, err := childproc.Start("registry", bin, []string{"serve", cfg}, []string{"OTEL_TRACES_EXPORTER=none", "OTEL_SDK_DISABLED=true"}, filepath.Join(dir, "registry.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Stop(5 * time.Second) })
	poll.Within(t, time.Minute, "the registry answers on "+addr, func() bool {
		resp, err := http.Get("http://" + addr + "/v2/")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return addr
}

// checkPush: make release-push refuses a registry the release was not
// made for, then pushes the image and the chart and prints their digests;
// the registry then serves the index under the release's tag, helm pulls
// the release's chart archive byte for byte, and what README's helm
// install would apply is the release's manifest.
func checkPush(t *testing.T, src, registry, key, digest string, rel map[string][]byte) {
	t.Helper()
	out, err := makeRelease(t, src, "release-push", "REGISTRY=other.invalid/x", "PLAIN_HTTP=1", "SIGNING_KEY="+key)
	if err == nil || !strings.Contains(out, "push it to REGISTRY="+registry) {
		t.Errorf("make release-push to another registry: %v, want refused naming %s:\n%s", err, registry, out)
	}
	out, err = makeRelease(t, src, "release-push", "REGISTRY="+registry, "PLAIN_HTTP=1", "SIGNING_KEY="+key)
	if err != nil {
		t.Fatalf("make release-push: %v\n%s", err, out)
	}
	t.Logf("make release-push:\n%s", out)
	if !strings.Contains(out, "pushed "+registry+"/ambient-cni@"+digest) || !strings.Contains(out, "Digest: sha256:") {
		t.Errorf("make release-push did not print the image's digest %s and the chart's", digest)
	}
	if !strings.Contains(out, "verified with "+releasePubKey) {
		t.Errorf("make release-push did not sign and verify the release")
	}
	ref, err := name.ParseReference(registry + "/ambient-cni:" + testVersion)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Head(ref)
	if err != nil {
		t.Fatal(err)
	}
	if desc.Digest.String() != digest {
		t.Errorf("the registry's %s is %s, want the release's index %s", ref, desc.Digest, digest)
	}
	chartRef := "oci://" + registry + "/charts/ambient-cni"
	dir := t.TempDir()
	helm(t, "pull", chartRef, "--version", testVersion, "--plain-http", "-d", dir)
	tgz := "ambient-cni-" + testVersion + ".tgz"
	if got, err := os.ReadFile(filepath.Join(dir, tgz)); err != nil || !bytes.Equal(got, rel[tgz]) {
		t.Errorf("helm pull %s --version %s: %v, not the release's archive", chartRef, testVersion, err)
	}
	m := helm(t, "template", "ambient-cni", chartRef, "--version", testVersion, "--plain-http", "--namespace", "istio-system", "--no-hooks")
	body := func(s string) string { return s[strings.Index(s, "\n---\n"):] }
	if want := string(rel["ambient-cni.yaml"]); body("\n"+string(m)) != body(want) {
		t.Errorf("the pushed chart with its defaults does not render the release's manifest (first difference at line %d)", firstDiffLine(body("\n"+string(m)), body(want)))
	}
}

// helm runs the cached helm with its cache and config in a temporary
// directory, so nothing of the user's is read or written.
func helm(t *testing.T, args ...string) []byte {
	t.Helper()
	bin := kubeenv.RequireTool(t, kubeenv.Helm)
	home := t.TempDir()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(home, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(home, "config"),
		"HELM_DATA_HOME="+filepath.Join(home, "data"),
		"KUBECONFIG="+filepath.Join(home, "no-kubeconfig"))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.Bytes()
}

var imageLine = regexp.MustCompile(`(?m)^\s*image:\s*"?([^"\s]+)"?\s*$`)

// checkManifest: every image is the index by digest, and the objects are
// the source tree's manifest's, but for the image and the version.
func checkManifest(t *testing.T, m, image string) {
	t.Helper()
	imgs := imageLine.FindAllStringSubmatch(m, -1)
	if len(imgs) == 0 {
		t.Fatal("the release's manifest names no image")
	}
	for _, s := range imgs {
		if s[1] != image {
			t.Errorf("the release's manifest names %s, want %s", s[1], image)
		}
	}
	root, _ := kubeenv.RepoRoot()
	src := read(t, filepath.Join(root, "deploy", "manifests", "ambient-cni.yaml"))
	srcVersion := strings.TrimSpace(read(t, filepath.Join(root, "VERSION")))
	body := func(s string) string { return s[strings.Index(s, "\n---\n"):] }
	want := strings.NewReplacer(
		"ghcr.io/ambient-cni/ambient-cni:"+srcVersion, image,
		`"`+srcVersion+`"`, `"`+testVersion+`"`,
		"ambient-cni-"+srcVersion, "ambient-cni-"+testVersion,
	).Replace(body(src))
	if got := body(m); got != want {
		t.Errorf("the release's manifest is not the source tree's with the release's image and version (first difference at line %d)", firstDiffLine(got, want))
	}
}

func firstDiffLine(a, b string) int {
	la, lb := strings.Split(a, "\n"), strings.Split(b, "\n")
	for i := range min(len(la), len(lb)) {
		if la[i] != lb[i] {
			return i + 1
		}
	}
	return min(len(la), len(lb)) + 1
}

// untar returns a tar.gz's regular files.
func untar(t *testing.T, b []byte) map[string]*struct {
	mode int64
	data []byte
} {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*struct {
		mode int64
		data []byte
	}{}
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = &struct {
			mode int64
			data []byte
		}{h.Mode, data}
	}
}

// checkChart: the chart's version is the release's and its default image
// the index by digest in the release's registry.
func checkChart(t *testing.T, tgz []byte, registry, digest string) {
	t.Helper()
	if tgz == nil {
		t.Fatal("no chart archive")
	}
	fs := untar(t, tgz)
	var chart struct{ Version, AppVersion string }
	var values struct {
		Image struct{ Repository, Tag, Digest string }
	}
	for name, v := range map[string]any{"ambient-cni/Chart.yaml": &chart, "ambient-cni/values.yaml": &values} {
		f := fs[name]
		if f == nil {
			t.Fatalf("the chart has no %s", name)
		}
		if err := yaml.Unmarshal(f.data, v); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
	}
	if chart.Version != testVersion || chart.AppVersion != testVersion {
		t.Errorf("chart version %s appVersion %s, want %s", chart.Version, chart.AppVersion, testVersion)
	}
	if values.Image.Repository != registry+"/ambient-cni" || values.Image.Digest != digest || values.Image.Tag != "" {
		t.Errorf("the chart's default image %+v, want %s/ambient-cni@%s", values.Image, registry, digest)
	}
}

// checkSums: SHA256SUMS lists every other file with its sum.
func checkSums(t *testing.T, rel map[string][]byte) {
	t.Helper()
	listed := map[string]bool{}
	for line := range strings.SplitSeq(strings.TrimSuffix(string(rel["SHA256SUMS"]), "\n"), "\n") {
		s, name, ok := strings.Cut(line, "  ")
		if !ok {
			t.Fatalf("SHA256SUMS line %q", line)
		}
		if b, ok := rel[name]; !ok || sum(b) != s {
			t.Errorf("SHA256SUMS: %s %s does not match the file", s, name)
		}
		listed[name] = true
	}
	for n := range rel {
		if !listed[n] && n != "SHA256SUMS" {
			t.Errorf("SHA256SUMS does not list %s", n)
		}
	}
}

// checkKrew: krew's manifest, each platform's sha256 its archive's, each
// archive the plugin built for that platform, stamped with the version.
func checkKrew(t *testing.T, rel map[string][]byte) {
	t.Helper()
	var p struct {
		APIVersion, Kind string
		Metadata         struct{ Name string }
		Spec             struct {
			Version   string
			Platforms []struct {
				Selector         struct{ MatchLabels map[string]string }
				URI, Sha256, Bin string
			}
		}
	}
	if err := yaml.Unmarshal(rel["kubectl-ambient_cni.krew.yaml"], &p); err != nil {
		t.Fatal(err)
	}
	if p.APIVersion != "krew.googlecontainertools.github.com/v1alpha2" || p.Kind != "Plugin" || p.Metadata.Name != "ambient-cni" || p.Spec.Version != "v"+testVersion {
		t.Errorf("krew manifest: apiVersion %s kind %s name %s version %s", p.APIVersion, p.Kind, p.Metadata.Name, p.Spec.Version)
	}
	var seen []string
	for _, pl := range p.Spec.Platforms {
		goos, goarch := pl.Selector.MatchLabels["os"], pl.Selector.MatchLabels["arch"]
		seen = append(seen, goos+"/"+goarch)
		name := path.Base(pl.URI)
		archive, ok := rel[name]
		if !ok {
			t.Errorf("%s/%s: no archive %s in the release", goos, goarch, name)
			continue
		}
		if sum(archive) != pl.Sha256 {
			t.Errorf("%s: krew's sha256 %s, the archive's %s", name, pl.Sha256, sum(archive))
		}
		bin := untar(t, archive)[pl.Bin]
		if bin == nil || bin.mode&0o111 == 0 {
			t.Errorf("%s: no executable %s", name, pl.Bin)
			continue
		}
		if got := binaryPlatform(t, bin.data); got != goos+"/"+goarch {
			t.Errorf("%s holds a binary for %s", name, got)
		}
		if goos == runtime.GOOS && goarch == runtime.GOARCH {
			exe := filepath.Join(t.TempDir(), pl.Bin)
			if err := os.WriteFile(exe, bin.data, 0o755); err != nil {
				t.Fatal(err)
			}
			out, err := exec.Command(exe, "--version").CombinedOutput()
			if err != nil || !strings.Contains(string(out), testVersion) {
				t.Errorf("%s --version: %v %q, want the version %s", pl.Bin, err, out, testVersion)
			}
		}
	}
	if slices.Sort(seen); !slices.Equal(seen, []string{"darwin/amd64", "darwin/arm64", "linux/amd64", "linux/arm64"}) {
		t.Errorf("krew platforms %v, want linux and darwin, amd64 and arm64", seen)
	}
}

func binaryPlatform(t *testing.T, b []byte) string {
	t.Helper()
	if f, err := elf.NewFile(bytes.NewReader(b)); err == nil {
		switch f.Machine {
		case elf.EM_X86_64:
			return "linux/amd64"
		case elf.EM_AARCH64:
			return "linux/arm64"
		}
		return "linux/" + f.Machine.String()
	}
	if f, err := macho.NewFile(bytes.NewReader(b)); err == nil {
		switch f.Cpu {
		case macho.CpuAmd64:
			return "darwin/amd64"
		case macho.CpuArm64:
			return "darwin/arm64"
		}
		return "darwin/" + f.Cpu.String()
	}
	return "unknown"
}
