package deploy

import (
	"archive/tar"
	"io"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"testing"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
)

// deploy/Dockerfile (for Docker users) builds the same layout of files
// as make image (hack/imagebuild): its COPY destinations are make image's
// non-base files, each the binary of the same name.
func TestDockerfileSameFilesAsMakeImage(t *testing.T) {
	d := parseDockerfile(t)
	dir := t.TempDir()
	rootfs := filepath.Join(dir, "rootfs.tar")
	f, err := os.Create(rootfs)
	if err != nil {
		t.Fatal(err)
	}
	tw := tar.NewWriter(f)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "./etc/", Mode: 0o755}); err != nil {
		t.Fatal(err)
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	for _, name := range ociimage.AgentFiles {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(name), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	idx, err := ociimage.Build(ociimage.Spec{Version: "v0", Platforms: []ociimage.Platform{{Arch: "amd64", Rootfs: rootfs, BinDir: dir}}})
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	img, err := idx.Image(m.Manifests[0].Digest)
	if err != nil {
		t.Fatal(err)
	}
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	// The top layer is the agent's: its regular files.
	rc, err := layers[len(layers)-1].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	made := map[string]string{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Typeflag == tar.TypeReg {
			data, _ := io.ReadAll(tr)
			made["/"+h.Name] = string(data)
		}
	}
	if got, want := slices.Sorted(maps.Keys(d.copies)), slices.Sorted(maps.Keys(made)); !slices.Equal(got, want) {
		t.Fatalf("Dockerfile COPY destinations %q, make image's files %q", got, want)
	}
	for dst, name := range made {
		if got := path.Base(d.copies[dst]); got != name {
			t.Errorf("%s: Dockerfile copies %s, make image puts %s", dst, got, name)
		}
	}
}
