package imagearchive

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// readArchive returns the archive's entries by name.
func readArchive(t *testing.T, b []byte) map[string][]byte {
	t.Helper()
	out := map[string][]byte{}
	tr := tar.NewReader(bytes.NewReader(b))
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
		out[h.Name] = data
	}
}

func tarFiles(t *testing.T, b []byte) map[string]*tar.Header {
	t.Helper()
	out := map[string]*tar.Header{}
	tr := tar.NewReader(bytes.NewReader(b))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = h
	}
}

func TestWriteDockerArchive(t *testing.T) {
	base := filepath.Join(t.TempDir(), "base.tar")
	baseLayer, err := FilesLayer(File{Path: "/etc/os-release", Data: []byte("ID=test\n")})
	if err != nil {
		t.Fatal(err)
	}
	r, _, _ := baseLayer.Open()
	baseBytes, _ := io.ReadAll(r)
	if err := os.WriteFile(base, baseBytes, 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(t.TempDir(), "app")
	if err := os.WriteFile(bin, []byte("#!binary"), 0o755); err != nil {
		t.Fatal(err)
	}
	top, err := FilesLayer(File{Path: "/usr/local/bin/app", Mode: 0o755, Source: bin})
	if err != nil {
		t.Fatal(err)
	}
	img := Image{Name: "docker.io/local/app:1", Entrypoint: []string{"/usr/local/bin/app"}, Env: []string{"A=b"}, Layers: []Layer{FileLayer(base), top}, Arch: "amd64"}
	var buf bytes.Buffer
	if err := Write(&buf, img); err != nil {
		t.Fatal(err)
	}
	entries := readArchive(t, buf.Bytes())

	var man []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(entries["manifest.json"], &man); err != nil {
		t.Fatalf("manifest.json: %v", err)
	}
	if len(man) != 1 || len(man[0].RepoTags) != 1 || man[0].RepoTags[0] != img.Name || len(man[0].Layers) != 2 {
		t.Fatalf("manifest %+v", man)
	}
	cfgData, ok := entries[man[0].Config]
	if !ok {
		t.Fatalf("config %s missing", man[0].Config)
	}
	sum := sha256.Sum256(cfgData)
	if man[0].Config != hex.EncodeToString(sum[:])+".json" {
		t.Errorf("config file %s is not named by its digest", man[0].Config)
	}
	var cfg struct {
		Architecture, OS string
		Config           struct{ Entrypoint, Env []string }
		RootFS           struct {
			Type    string
			DiffIDs []string `json:"diff_ids"`
		} `json:"rootfs"`
	}
	if err := json.Unmarshal(cfgData, &cfg); err != nil {
		t.Fatal(err)
	}
	if cfg.OS != "linux" || cfg.Architecture != "amd64" || cfg.RootFS.Type != "layers" {
		t.Errorf("config %+v", cfg)
	}
	if strings.Join(cfg.Config.Entrypoint, " ") != "/usr/local/bin/app" || strings.Join(cfg.Config.Env, " ") != "A=b" {
		t.Errorf("run config %+v", cfg.Config)
	}
	for i, lf := range man[0].Layers {
		data, ok := entries[lf]
		if !ok {
			t.Fatalf("layer %s missing", lf)
		}
		s := sha256.Sum256(data)
		if want := "sha256:" + hex.EncodeToString(s[:]); cfg.RootFS.DiffIDs[i] != want {
			t.Errorf("layer %d diff id %s, content hashes to %s", i, cfg.RootFS.DiffIDs[i], want)
		}
	}
	if !bytes.Equal(entries[man[0].Layers[0]], baseBytes) {
		t.Error("base layer not copied verbatim")
	}
	files := tarFiles(t, entries[man[0].Layers[1]])
	for _, d := range []string{"usr/", "usr/local/", "usr/local/bin/"} {
		if h, ok := files[d]; !ok || h.Typeflag != tar.TypeDir || h.Mode != 0o755 {
			t.Errorf("directory %s: %+v", d, h)
		}
	}
	if h := files["usr/local/bin/app"]; h == nil || h.Mode != 0o755 || h.Size != int64(len("#!binary")) {
		t.Errorf("binary entry %+v", h)
	}

	// Same input, same bytes: layers and configs are reproducible.
	var again bytes.Buffer
	if err := Write(&again, img); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(buf.Bytes(), again.Bytes()) {
		t.Error("writing the same image twice gave different archives")
	}
}

func TestWriteRejects(t *testing.T) {
	l, err := FilesLayer(File{Path: "a", Data: []byte("x")})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"", "app:1", "docker.io/local/app", "docker.io/local/app:", "docker.io/Local/App:1", "docker.io/local/app@sha256:00:1", "docker.io/local app:1"} {
		if err := Write(io.Discard, Image{Name: name, Layers: []Layer{l}}); err == nil {
			t.Errorf("name %q accepted", name)
		}
	}
	if err := Write(io.Discard, Image{Name: "docker.io/local/app:1"}); err == nil {
		t.Error("image without layers accepted")
	}
	if err := Write(io.Discard, Image{Name: "docker.io/local/app:1", Layers: []Layer{FileLayer(filepath.Join(t.TempDir(), "missing.tar"))}}); err == nil {
		t.Error("missing layer file accepted")
	}
	if _, err := FilesLayer(File{Path: "/", Data: []byte("x")}); err == nil {
		t.Error("file at the root accepted")
	}
	if _, err := FilesLayer(File{Path: "a", Data: []byte("x")}, File{Path: "/a", Data: []byte("y")}); err == nil {
		t.Error("duplicate path accepted")
	}
	if _, err := FilesLayer(File{Path: "a", Data: []byte("x"), Source: "/etc/hostname"}); err == nil {
		t.Error("Source and Data both accepted")
	}
}

func TestWriteFileIsAtomic(t *testing.T) {
	dir := t.TempDir()
	l, _ := FilesLayer(File{Path: "a", Data: []byte("x")})
	if err := WriteFile(filepath.Join(dir, "img.tar"), Image{Name: "bad"}); err == nil {
		t.Fatal("bad image written")
	}
	if des, _ := os.ReadDir(dir); len(des) != 0 {
		t.Fatalf("failed write left %v", des)
	}
	if err := WriteFile(filepath.Join(dir, "img.tar"), Image{Name: "docker.io/local/a:1", Layers: []Layer{l}}); err != nil {
		t.Fatal(err)
	}
	if des, _ := os.ReadDir(dir); len(des) != 1 {
		t.Fatalf("want only img.tar, got %v", des)
	}
}
