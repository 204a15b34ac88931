package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

const changelog = `# Changelog

## Unreleased

- next

## [1.2.0-rc.1] - 2026-12-06

### Added

- a thing

## [1.1.0]

- older
`

// A release's notes are its CHANGELOG section, nothing of the others; a
// version without a section is refused with what to do.
func TestNotes(t *testing.T) {
	got, err := Notes([]byte(changelog), "1.2.0-rc.1")
	if err != nil {
		t.Fatal(err)
	}
	if want := "### Added\n\n- a thing"; got != want {
		t.Errorf("notes %q, want %q", got, want)
	}
	if got, err := Notes([]byte(changelog), "1.1.0"); err != nil || got != "- older" {
		t.Errorf("the last section: %q, %v", got, err)
	}
	for _, v := range []string{"1.2.0", "1.2.0-rc", "Unreleased"} {
		if _, err := Notes([]byte(changelog), v); err == nil || !strings.Contains(err.Error(), `rename "## Unreleased"`) {
			t.Errorf("version %s: %v, want refused naming the fix", v, err)
		}
	}
}

func TestCheckVersion(t *testing.T) {
	for _, v := range []string{"0.1.0", "1.2.3-rc.1", "0.0.1-test", "1.0.0+build.5"} {
		if err := CheckVersion(v); err != nil {
			t.Errorf("%s: %v", v, err)
		}
	}
	for _, v := range []string{"v0.1.0", "0.1", "dev", "01.2.3", "1.2.3-", ""} {
		if err := CheckVersion(v); err == nil {
			t.Errorf("%s: accepted", v)
		}
	}
}

// The chart's values get the release's image; comments and the rest stay.
func TestStampValues(t *testing.T) {
	src, err := os.ReadFile("../../deploy/charts/ambient-cni/values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	const digest = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	out, err := StampValues(src, "reg.example:5000/x/ambient-cni", digest)
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		Image map[string]any `json:"image"`
	}
	if err := yaml.Unmarshal(out, &v); err != nil {
		t.Fatal(err)
	}
	if v.Image["repository"] != "reg.example:5000/x/ambient-cni" || v.Image["digest"] != digest || v.Image["tag"] != "" {
		t.Errorf("stamped image %v", v.Image)
	}
	if d := len(strings.Split(string(src), "\n")) - len(strings.Split(string(out), "\n")); d != 0 {
		t.Errorf("stamping changed the line count by %d", d)
	}
	if _, err := StampValues([]byte("image:\n  tag: x\nother:\n  repository: y\n  digest: z\n"), "r", "d"); err == nil {
		t.Error("keys outside the image block were stamped")
	}
}

func readTar(t *testing.T, b []byte) (*gzip.Reader, []*tar.Header) {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	var hs []*tar.Header
	tr := tar.NewReader(zr)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		hs = append(hs, h)
	}
	return zr, hs
}

// helm's archive differs from one packaging to the next only in its
// entries' times: normalized, two packagings are one archive.
func TestNormalizeChart(t *testing.T) {
	pack := func(now time.Time) []byte {
		var b bytes.Buffer
		zw := gzip.NewWriter(&b)
		zw.Comment, zw.Extra = "Helm", []byte("+extra")
		tw := tar.NewWriter(zw)
		for _, n := range []string{"ambient-cni/Chart.yaml", "ambient-cni/values.yaml"} {
			if err := tw.WriteHeader(&tar.Header{Name: n, Mode: 0o644, Size: 2, ModTime: now, Uname: "someone", Uid: 1000}); err != nil {
				t.Fatal(err)
			}
			if _, err := tw.Write([]byte("x\n")); err != nil {
				t.Fatal(err)
			}
		}
		if err := tw.Close(); err != nil {
			t.Fatal(err)
		}
		if err := zw.Close(); err != nil {
			t.Fatal(err)
		}
		return b.Bytes()
	}
	mtime := time.Unix(1765000000, 0)
	a, err := NormalizeChart(pack(time.Unix(1700000000, 0)), mtime)
	if err != nil {
		t.Fatal(err)
	}
	b, err := NormalizeChart(pack(time.Unix(1800000000, 0)), mtime)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a, b) {
		t.Fatal("two packagings of one chart differ after normalizing")
	}
	zr, hs := readTar(t, a)
	if zr.Comment != "Helm" || string(zr.Extra) != "+extra" {
		t.Errorf("gzip header comment %q extra %q, want helm's kept", zr.Comment, zr.Extra)
	}
	if len(hs) != 2 {
		t.Fatalf("%d entries, want 2", len(hs))
	}
	for _, h := range hs {
		if !h.ModTime.Equal(mtime) || h.Uid != 0 || h.Uname != "" {
			t.Errorf("%s: time %v uid %d uname %q", h.Name, h.ModTime, h.Uid, h.Uname)
		}
	}
}

// The krew manifest is krew's format and its sums are the archives'.
func TestKrewManifest(t *testing.T) {
	archives := map[string][]byte{}
	for _, p := range pluginPlatforms {
		b, err := Archive(PluginBinary, []byte(p), time.Unix(1765000000, 0))
		if err != nil {
			t.Fatal(err)
		}
		archives[p] = b
	}
	out, err := KrewManifest("1.2.0-rc.1", "https://example.invalid/dl/", "https://example.invalid", archives)
	if err != nil {
		t.Fatal(err)
	}
	var p KrewPlugin
	if err := yaml.UnmarshalStrict(out, &p); err != nil {
		t.Fatal(err)
	}
	if p.APIVersion != "krew.googlecontainertools.github.com/v1alpha2" || p.Kind != "Plugin" || p.Metadata.Name != "ambient-cni" || p.Spec.Version != "v1.2.0-rc.1" || p.Spec.ShortDescription == "" || strings.Contains(p.Spec.ShortDescription, "\n") {
		t.Errorf("manifest:\n%s", out)
	}
	if len(p.Spec.Platforms) != len(pluginPlatforms) {
		t.Fatalf("%d platforms, want %d", len(p.Spec.Platforms), len(pluginPlatforms))
	}
	for _, pl := range p.Spec.Platforms {
		key := pl.Selector.MatchLabels["os"] + "/" + pl.Selector.MatchLabels["arch"]
		sum := sha256.Sum256(archives[key])
		if pl.Sha256 != hex.EncodeToString(sum[:]) {
			t.Errorf("%s: sha256 %s is not its archive's", key, pl.Sha256)
		}
		name := PluginArchiveName("1.2.0-rc.1", pl.Selector.MatchLabels["os"], pl.Selector.MatchLabels["arch"])
		if pl.URI != "https://example.invalid/dl/"+name || pl.Bin != PluginBinary {
			t.Errorf("%s: uri %s bin %s", key, pl.URI, pl.Bin)
		}
		_, hs := readTar(t, archives[key])
		if len(hs) != 1 || hs[0].Name != pl.Bin || hs[0].Mode != 0o755 {
			t.Errorf("%s: archive entries %v, want the one executable bin names", key, hs)
		}
	}
}

// SHA256SUMS covers every file below the directory but itself, in
// sha256sum's format.
func TestSums(t *testing.T) {
	dir := t.TempDir()
	for name, data := range map[string]string{"b.txt": "b", "a/z.bin": "z", SumsName: "old"} {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := Sums(dir)
	if err != nil {
		t.Fatal(err)
	}
	sum := func(s string) string { h := sha256.Sum256([]byte(s)); return hex.EncodeToString(h[:]) }
	if want := sum("z") + "  a/z.bin\n" + sum("b") + "  b.txt\n"; string(got) != want {
		t.Errorf("SHA256SUMS:\n%s\nwant:\n%s", got, want)
	}
}

func TestCheckManifestImage(t *testing.T) {
	const img = "r.example/ambient-cni@sha256:abc"
	if err := CheckManifestImage([]byte("  image: r.example/ambient-cni@sha256:abc\n    image: \"r.example/ambient-cni@sha256:abc\"\n"), img); err != nil {
		t.Error(err)
	}
	if err := CheckManifestImage([]byte("  image: r.example/ambient-cni@sha256:abc\n  image: r.example/ambient-cni:0.1.0\n"), img); err == nil {
		t.Error("a tag-named image passed")
	}
}
