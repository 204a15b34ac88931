package attest

import (
	"debug/buildinfo"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
	"github.com/ambient-cni/ambient-cni/test/lib/sbomcheck"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// rootfsTool is the cached Debian base of make image for arch (skips, or
// fails under CI=true, when it is not built).
func rootfsTool(t *testing.T, arch string) string {
	t.Helper()
	if os.Getenv("AMBIENT_UNIT_ONLY") != "" {
		t.Skip("skipping: needs the image rootfs, and AMBIENT_UNIT_ONLY is set")
	}
	out, err := exec.Command("bash", "../../kube-tools.sh", "--path", "image-rootfs-"+arch).Output()
	if err != nil {
		t.Fatalf("kube-tools.sh --path image-rootfs-%s: %v", arch, err)
	}
	p := strings.TrimSpace(string(out))
	if _, err := os.Stat(p); err != nil {
		testnet.Missing(t, "image-rootfs-"+arch+" is not built: hack/kube-tools.sh image-rootfs-"+arch+" (make image builds it)")
	}
	return p
}

// cachedTool is a Go binary of the tools cache (hack/kube-tools.sh NAME).
func cachedTool(t *testing.T, name string) string {
	t.Helper()
	out, err := exec.Command("bash", "../../kube-tools.sh", "--path", name).Output()
	p := strings.TrimSpace(string(out))
	if err != nil || p == "" {
		t.Fatalf("kube-tools.sh --path %s: %v", name, err)
	}
	if _, err := os.Stat(p); err != nil {
		testnet.Missing(t, name+" is not built: make tools")
	}
	return p
}

// The SBOM of an image make image builds (the real builder, the real
// Debian base, real Go binaries: etcd and this test) lists every module go version -m
// finds in each binary and every package dpkg-query finds installed in
// the base, and nothing else; the base's dpkg database lists the packages
// make image's base is made of (the extract variant leaves it empty but
// for a placeholder unless the rootfs hook fills it).
func TestSBOMListsEveryGoModuleAndDebianPackage(t *testing.T) {
	arch := runtime.GOARCH
	rootfs := rootfsTool(t, arch)
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	sources := map[string]string{
		ociimage.AgentCommand:     cachedTool(t, "etcd"),
		ociimage.PluginBinary:     cachedTool(t, "etcd"),
		ociimage.FallbackBinary:   exe,
		ociimage.UninstallCommand: exe,
	}
	bins := t.TempDir()
	for path, name := range ociimage.AgentFiles {
		if err := os.Symlink(sources[path], filepath.Join(bins, name)); err != nil {
			t.Fatal(err)
		}
	}
	idx, err := ociimage.Build(ociimage.Spec{
		Platforms: []ociimage.Platform{{Arch: arch, Rootfs: rootfs, BinDir: bins}},
		Version:   "0.0.1-test", Revision: "0123456789abcdef", Source: "https://example.invalid/ambient-cni",
	})
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
	img, err := idx.Image(im.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	c, err := ReadContents(img)
	if err != nil {
		t.Fatal(err)
	}
	b, err := WriteSBOM(SBOM(SBOMInput{
		Name: "registry.invalid/ambient-cni", Version: "0.0.1-test", Index: digest,
		Namespace: "https://example.invalid/ambient-cni", Created: time.Unix(1765000000, 0),
		Platforms: []Contents{c},
	}))
	if err != nil {
		t.Fatal(err)
	}
	doc, err := ReadSBOM(b) // the library's reader: valid SPDX 2.3 JSON
	if err != nil {
		t.Fatalf("the SBOM does not read back as SPDX: %v", err)
	}
	if doc.SPDXVersion != "SPDX-2.3" {
		t.Errorf("spdxVersion %q", doc.SPDXVersion)
	}

	got := sbomcheck.ImageOf(doc, arch)
	goVersions := map[string]string{}
	for _, bin := range slices.Sorted(maps.Keys(ociimage.AgentFiles)) {
		wantMods, goVersion := sbomcheck.GoVersionM(t, sources[bin])
		slices.Sort(wantMods)
		goVersions[bin] = goVersion
		mods, ok := got.Binaries[bin]
		if !ok {
			t.Errorf("the SBOM does not list the image's Go binary %s", bin)
			continue
		}
		if !slices.Equal(mods, wantMods) {
			t.Errorf("%s: the SBOM lists %d modules, go version -m %d:\n  only in the SBOM: %v\n  only in go version -m: %v",
				bin, len(mods), len(wantMods), sbomcheck.Minus(mods, wantMods), sbomcheck.Minus(wantMods, mods))
		}
		t.Logf("%s (%s): %d modules", bin, filepath.Base(sources[bin]), len(mods))
	}
	if len(got.Binaries) != len(ociimage.AgentFiles) {
		t.Errorf("the SBOM lists the Go binaries %v, want the image's %d", slices.Sorted(maps.Keys(got.Binaries)), len(ociimage.AgentFiles))
	}
	for _, p := range doc.Packages {
		if p.PackageFileName != "" && !strings.Contains(p.PackageComment, goVersions[p.PackageFileName]) {
			t.Errorf("%s: comment %q does not name %s", p.PackageFileName, p.PackageComment, goVersions[p.PackageFileName])
		}
	}
	installed := sbomcheck.DpkgInstalled(t, rootfs)
	if !slices.Equal(got.Debs, installed) {
		t.Errorf("the SBOM lists %d Debian packages, dpkg-query %d installed in the base:\n  only in the SBOM: %v\n  only in dpkg-query: %v",
			len(got.Debs), len(installed), sbomcheck.Minus(got.Debs, installed), sbomcheck.Minus(installed, got.Debs))
	}
	// What make image's base is made of (hack/kube-tools.sh): the
	// netfilter tools and the essential set.
	for _, name := range []string{"iptables", "nftables", "ipset", "libc6", "dash", "base-files"} {
		if !slices.ContainsFunc(installed, func(p string) bool { return strings.HasPrefix(p, name+"@") }) {
			t.Errorf("the base's dpkg database lacks %s (%d packages listed: %v)", name, len(installed), installed)
		}
	}
	t.Logf("SBOM of %s: %d Go binaries, %d Debian packages (%s)", digest, len(got.Binaries), len(got.Debs), c.Distro)
}

func TestParseDpkgStatus(t *testing.T) {
	status := "Package: a\nStatus: install ok installed\nVersion: 1.0-1\nArchitecture: amd64\nSource: asrc (1.0)\nDescription: x\n continued\n\n" +
		"Package: b\nStatus: deinstall ok config-files\nVersion: 2\n\n\n" +
		"Package: c\nStatus: install ok installed\nVersion: 3\nArchitecture: all\n"
	got, err := ParseDpkgStatus([]byte(status), false)
	if err != nil {
		t.Fatal(err)
	}
	want := []DebPackage{{Name: "a", Version: "1.0-1", Arch: "amd64", Source: "asrc"}, {Name: "c", Version: "3", Arch: "all"}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if _, err := ParseDpkgStatus([]byte("Status: install ok installed\n"), false); err == nil {
		t.Error("a paragraph without Package: no error")
	}
}

// A replaced module is listed as its replacement, as go version -m's
// "=>" line says, and the standard library as stdlib at the Go version.
func TestModulesResolveReplacements(t *testing.T) {
	info := &buildinfo.BuildInfo{GoVersion: "go1.26.8"}
	info.Main = debug.Module{Path: "example.com/main", Version: "(devel)"}
	info.Deps = []*debug.Module{
		{Path: "example.com/a", Version: "v1.0.0", Sum: "h1:a"},
		{Path: "example.com/b", Version: "v0.1.0", Replace: &debug.Module{Path: "example.com/fork/b", Version: "v0.1.1", Sum: "h1:b"}},
	}
	want := []Module{
		{Path: "example.com/main", Version: "(devel)"},
		{Path: "example.com/a", Version: "v1.0.0", Sum: "h1:a"},
		{Path: "example.com/fork/b", Version: "v0.1.1", Sum: "h1:b"},
		{Path: "stdlib", Version: "go1.26.8"},
	}
	if got := Modules(info); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("Modules: %v, want %v", got, want)
	}
}
