package ociimage

import (
	"archive/tar"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
)

// tarEntry is one entry of a synthetic rootfs.
type tarEntry struct {
	hdr  tar.Header
	data string
}

// writeRootfs writes a rootfs tarball as mmdebstrap does (./ names, its
// own times and owner names), in the given order.
func writeRootfs(t *testing.T, file string, mtime time.Time, entries []tarEntry) {
	t.Helper()
	f, err := os.Create(file)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	for _, e := range entries {
		h := e.hdr
		h.ModTime, h.Uname, h.Gname = mtime, "someone", "somegroup"
		h.Size = int64(len(e.data))
		if h.Typeflag != tar.TypeReg {
			h.Size = 0
		}
		if err := tw.WriteHeader(&h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write([]byte(e.data)); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

func rootfsEntries() []tarEntry {
	return []tarEntry{
		{hdr: tar.Header{Typeflag: tar.TypeDir, Name: "./", Mode: 0o755}},
		{hdr: tar.Header{Typeflag: tar.TypeDir, Name: "./usr/", Mode: 0o755}},
		{hdr: tar.Header{Typeflag: tar.TypeDir, Name: "./usr/sbin/", Mode: 0o755}},
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "./usr/sbin/xtables-nft-multi", Mode: 0o755}, data: "elf"},
		{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: "./usr/sbin/iptables-nft", Linkname: "xtables-nft-multi", Mode: 0o777}},
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "./etc/shadow", Mode: 0o640, Gid: 42}, data: "root:*:"},
		{hdr: tar.Header{Typeflag: tar.TypeDir, Name: "./etc/", Mode: 0o755}},
		{hdr: tar.Header{Typeflag: tar.TypeDir, Name: "./dev/", Mode: 0o755}},
		{hdr: tar.Header{Typeflag: tar.TypeChar, Name: "./dev/null", Mode: 0o666, Devmajor: 1, Devminor: 3}},
		{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "./usr/sbin/a-perl", Mode: 0o755}, data: "#!perl"},
		{hdr: tar.Header{Typeflag: tar.TypeLink, Name: "./usr/sbin/0-hardlink", Linkname: "./usr/sbin/a-perl"}},
	}
}

// inputs writes two platforms' synthetic inputs under dir: rootfs tars
// (entries in the given order, with the given time) and binaries.
func inputs(t *testing.T, dir string, mtime time.Time, reverse bool) Spec {
	t.Helper()
	s := Spec{Version: "v1.2.3", Revision: "abc", Source: "https://example.invalid/repo"}
	for _, arch := range []string{"amd64", "arm64"} {
		e := rootfsEntries()
		if reverse {
			// Parents after children, the hard link before its target.
			slices.Reverse(e)
		}
		rootfs := filepath.Join(dir, arch+".tar")
		writeRootfs(t, rootfs, mtime, e)
		bin := filepath.Join(dir, arch)
		if err := os.MkdirAll(bin, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, name := range AgentFiles {
			if err := os.WriteFile(filepath.Join(bin, name), []byte(name+" for "+arch), 0o700); err != nil {
				t.Fatal(err)
			}
			// The source file's time must not matter.
			if err := os.Chtimes(filepath.Join(bin, name), mtime, mtime); err != nil {
				t.Fatal(err)
			}
		}
		s.Platforms = append(s.Platforms, Platform{Arch: arch, Rootfs: rootfs, BinDir: bin})
	}
	return s
}

func digest(t *testing.T, s Spec) v1.Hash {
	t.Helper()
	idx, err := Build(s)
	if err != nil {
		t.Fatal(err)
	}
	d, err := idx.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// The same inputs give the same digest, whatever the rootfs tarball's
// entry order and times and the binaries' times; a changed binary or
// version changes it.
func TestReproducible(t *testing.T) {
	a := digest(t, inputs(t, t.TempDir(), time.Unix(1700000000, 0), false))
	b := digest(t, inputs(t, t.TempDir(), time.Unix(1800000000, 0), true))
	if a != b {
		t.Fatalf("same inputs, two digests: %s and %s", a, b)
	}
	s := inputs(t, t.TempDir(), time.Unix(1700000000, 0), false)
	if err := os.WriteFile(filepath.Join(s.Platforms[1].BinDir, "install-cni"), []byte("changed"), 0o755); err != nil {
		t.Fatal(err)
	}
	if c := digest(t, s); c == a {
		t.Fatal("a changed arm64 install-cni kept the digest")
	}
	s = inputs(t, t.TempDir(), time.Unix(1700000000, 0), false)
	s.Version = "v1.2.4"
	if c := digest(t, s); c == a {
		t.Fatal("a changed version kept the digest")
	}
}

// layerEntries lists a layer's tar headers in order.
func layerEntries(t *testing.T, l v1.Layer) []*tar.Header {
	t.Helper()
	rc, err := l.Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var out []*tar.Header
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, h)
	}
}

// The base layer is the rootfs normalized: sorted, hard links last, one
// time, numeric owners kept and names dropped, /dev empty.
func TestBaseLayer(t *testing.T) {
	s := inputs(t, t.TempDir(), time.Unix(1700000000, 0), true)
	l, err := BaseLayer(s.Platforms[0].Rootfs)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, h := range layerEntries(t, l) {
		names = append(names, h.Name)
		if !h.ModTime.Equal(Epoch) || h.Uname != "" || h.Gname != "" {
			t.Errorf("%s: time %v owner names %q/%q, want epoch and none", h.Name, h.ModTime, h.Uname, h.Gname)
		}
		if h.Name == "etc/shadow" && h.Gid != 42 {
			t.Errorf("etc/shadow gid %d, want 42 (kept)", h.Gid)
		}
		if h.Typeflag == tar.TypeLink && h.Linkname != "usr/sbin/a-perl" {
			t.Errorf("hard link to %q, want usr/sbin/a-perl", h.Linkname)
		}
	}
	want := []string{"dev/", "etc/", "etc/shadow", "usr/", "usr/sbin/", "usr/sbin/a-perl", "usr/sbin/iptables-nft", "usr/sbin/xtables-nft-multi", "usr/sbin/0-hardlink"}
	if !slices.Equal(names, want) {
		t.Fatalf("entries %q, want %q", names, want)
	}
}

// A rootfs with an entry twice, or of a kind an image has no use for,
// is refused; a truncated one is an error.
func TestBaseLayerHostile(t *testing.T) {
	dir := t.TempDir()
	for name, entries := range map[string][]tarEntry{
		"twice": {{hdr: tar.Header{Typeflag: tar.TypeReg, Name: "./a", Mode: 0o644}}, {hdr: tar.Header{Typeflag: tar.TypeReg, Name: "a", Mode: 0o644}}},
		"fifo":  {{hdr: tar.Header{Typeflag: tar.TypeFifo, Name: "./run/fifo", Mode: 0o644}}},
	} {
		f := filepath.Join(dir, name+".tar")
		writeRootfs(t, f, time.Unix(0, 0), entries)
		if _, err := BaseLayer(f); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	f := filepath.Join(dir, "ok.tar")
	writeRootfs(t, f, time.Unix(0, 0), rootfsEntries())
	b, err := os.ReadFile(f)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(f, b[:700], 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := BaseLayer(f); err == nil {
		t.Error("truncated rootfs: no error")
	}
}

// imageFiles lists one image's non-directory entries by layer: path to
// mode, with the type in the mode bits.
func imageFiles(t *testing.T, img v1.Image) []map[string]os.FileMode {
	t.Helper()
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	var out []map[string]os.FileMode
	for _, l := range ls {
		m := map[string]os.FileMode{}
		for _, h := range layerEntries(t, l) {
			if h.Typeflag != tar.TypeDir {
				m["/"+h.Name] = h.FileInfo().Mode()
			}
		}
		out = append(out, m)
	}
	return out
}

// The index written as a layout reads back whole: both platforms, the
// labels, the agent's files on top of the base, root-owned and 0755.
func TestLayoutRoundTrip(t *testing.T) {
	s := inputs(t, t.TempDir(), time.Unix(1700000000, 0), false)
	idx, err := Build(s)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "image")
	if err := WriteLayout(dir, idx, s.Version); err != nil {
		t.Fatal(err)
	}
	back, err := ReadLayout(dir)
	if err != nil {
		t.Fatal(err)
	}
	d0, _ := idx.Digest()
	d1, err := back.Digest()
	if err != nil || d0 != d1 {
		t.Fatalf("read back %s (%v), wrote %s", d1, err, d0)
	}
	m, err := back.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if got := m.Annotations[LabelVersion]; got != s.Version {
		t.Errorf("index annotation %s = %q, want %q", LabelVersion, got, s.Version)
	}
	var arches []string
	for _, desc := range m.Manifests {
		arches = append(arches, desc.Platform.Architecture)
		img, err := back.Image(desc.Digest)
		if err != nil {
			t.Fatal(err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if cf.Architecture != desc.Platform.Architecture || cf.OS != "linux" || !cf.Created.Time.Equal(Epoch) {
			t.Errorf("%s config: arch %s os %s created %v", desc.Platform.Architecture, cf.Architecture, cf.OS, cf.Created)
		}
		for k, want := range map[string]string{LabelVersion: "v1.2.3", LabelRevision: "abc", LabelSource: s.Source, LabelTitle: "ambient-cni"} {
			if cf.Config.Labels[k] != want {
				t.Errorf("%s label %s = %q, want %q", desc.Platform.Architecture, k, cf.Config.Labels[k], want)
			}
		}
		if !slices.Equal(cf.Config.Entrypoint, []string{AgentCommand}) {
			t.Errorf("entrypoint %q", cf.Config.Entrypoint)
		}
		files := imageFiles(t, img)
		if len(files) != 2 {
			t.Fatalf("%d layers, want 2 (base, agent)", len(files))
		}
		for p := range AgentFiles {
			if files[1][p] != 0o755 {
				t.Errorf("%s: %s mode %v in the top layer, want 0755", desc.Platform.Architecture, p, files[1][p])
			}
		}
		if len(files[1]) != len(AgentFiles) {
			t.Errorf("top layer holds %v, want only the agent's files", files[1])
		}
	}
	if !slices.Equal(arches, []string{"amd64", "arm64"}) {
		t.Errorf("platforms %q, want amd64 and arm64", arches)
	}
}

// A layout pushes as it is: a registry (go-containerregistry's, on
// loopback) then serves the same index, both images and their platforms.
func TestPushLayout(t *testing.T) {
	s := inputs(t, t.TempDir(), time.Unix(1700000000, 0), false)
	idx, err := Build(s)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), "image")
	if err := WriteLayout(dir, idx, s.Version); err != nil {
		t.Fatal(err)
	}
	reg := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer reg.Close()
	ref, err := name.ParseReference(strings.TrimPrefix(reg.URL, "http://") + "/ambient-cni:" + s.Version)
	if err != nil {
		t.Fatal(err)
	}
	pushed, err := Push(dir, ref)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := idx.Digest()
	if pushed != want {
		t.Fatalf("pushed %s, built %s", pushed, want)
	}
	got, err := remote.Index(ref)
	if err != nil {
		t.Fatal(err)
	}
	if d, _ := got.Digest(); d != want {
		t.Fatalf("registry serves %s, pushed %s", d, want)
	}
	m, err := got.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	for _, desc := range m.Manifests {
		img, err := got.Image(desc.Digest)
		if err != nil {
			t.Fatal(err)
		}
		ls, err := img.Layers()
		if err != nil || len(ls) != 2 {
			t.Fatalf("%s: %d layers (%v)", desc.Platform.Architecture, len(ls), err)
		}
	}
}
