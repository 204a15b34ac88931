// Package imagearchive writes container images as docker-archive tarballs
// (what `docker save` writes and `ctr images import` reads) with the
// standard library only, so the real node gets its images without a
// registry, a Docker daemon or an image-building tool.
//
// An archive holds manifest.json (config file, repository tags, layer
// files), the image config (os, architecture, entrypoint, the layers'
// diff IDs) and one uncompressed tar per layer.
package imagearchive

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"runtime"
	"slices"
	"strings"
	"time"
)

// Image is one image to write.
type Image struct {
	// Name is the fully qualified reference, e.g. docker.io/local/app:1;
	// the runtime finds the image by it (pods use imagePullPolicy: Never).
	Name string
	// Entrypoint, Cmd, Env and WorkingDir are the image config's.
	Entrypoint []string
	Cmd        []string
	Env        []string
	WorkingDir string
	// Layers are applied in order, the first is the base.
	Layers []Layer
	// Arch defaults to runtime.GOARCH; the OS is always linux.
	Arch string
}

// Layer is an uncompressed tar stream that can be read more than once
// (once to hash it, once to copy it).
type Layer interface {
	// Open returns the tar stream and its size in bytes.
	Open() (io.ReadCloser, int64, error)
}

// FileLayer is a layer stored as a tar file, e.g. a root filesystem made
// by mmdebstrap.
type FileLayer string

// Open implements Layer.
func (f FileLayer) Open() (io.ReadCloser, int64, error) {
	fh, err := os.Open(string(f))
	if err != nil {
		return nil, 0, err
	}
	st, err := fh.Stat()
	if err != nil {
		_ = fh.Close()
		return nil, 0, err
	}
	return fh, st.Size(), nil
}

// File is one regular file of a FilesLayer.
type File struct {
	// Path inside the image, absolute or relative to its root.
	Path string
	// Mode holds the permission bits (0o755 for a binary).
	Mode fs.FileMode
	// Source is a file on the host to copy, or Data the content.
	Source string
	Data   []byte
}

// FilesLayer builds a layer from files; the directories above them are
// added (0755, root). Entries are sorted and carry a fixed time, so the
// same files give the same layer digest.
func FilesLayer(files ...File) (Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dirs := map[string]bool{}
	var names []string
	byName := map[string]File{}
	for _, f := range files {
		name := strings.TrimPrefix(path.Clean("/"+f.Path), "/")
		if name == "" || name == "." {
			return nil, fmt.Errorf("file %q: empty path", f.Path)
		}
		if _, dup := byName[name]; dup {
			return nil, fmt.Errorf("file %q given twice", f.Path)
		}
		byName[name] = f
		names = append(names, name)
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	dirList := make([]string, 0, len(dirs))
	for d := range dirs {
		dirList = append(dirList, d)
	}
	slices.Sort(dirList) // a parent sorts before its children
	slices.Sort(names)
	for _, d := range dirList {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return nil, err
		}
	}
	for _, name := range names {
		f := byName[name]
		data := f.Data
		if f.Source != "" {
			if data != nil {
				return nil, fmt.Errorf("file %q: both Source and Data set", f.Path)
			}
			var err error
			if data, err = os.ReadFile(f.Source); err != nil {
				return nil, fmt.Errorf("file %q: %w", f.Path, err)
			}
		}
		mode := f.Mode.Perm()
		if mode == 0 {
			mode = 0o644
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: int64(mode), Size: int64(len(data)), ModTime: epoch, Format: tar.FormatPAX}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return memLayer(buf.Bytes()), nil
}

// epoch is the time stamped on generated entries (reproducible layers).
var epoch = time.Unix(0, 0).UTC()

type memLayer []byte

func (m memLayer) Open() (io.ReadCloser, int64, error) {
	return io.NopCloser(bytes.NewReader(m)), int64(len(m)), nil
}

// DiffID returns a layer's digest ("sha256:<hex>" of the uncompressed tar).
func DiffID(l Layer) (string, error) {
	r, _, err := l.Open()
	if err != nil {
		return "", err
	}
	defer r.Close()
	h := sha256.New()
	if _, err := io.Copy(h, r); err != nil {
		return "", err
	}
	return "sha256:" + hex.EncodeToString(h.Sum(nil)), nil
}

// config is the subset of the OCI/Docker image config that runtimes read.
type config struct {
	Architecture string        `json:"architecture"`
	OS           string        `json:"os"`
	Created      string        `json:"created"`
	Config       runConfig     `json:"config"`
	RootFS       rootFS        `json:"rootfs"`
	History      []historyItem `json:"history"`
}

type runConfig struct {
	Entrypoint []string `json:"Entrypoint,omitempty"`
	Cmd        []string `json:"Cmd,omitempty"`
	Env        []string `json:"Env,omitempty"`
	WorkingDir string   `json:"WorkingDir,omitempty"`
}

type rootFS struct {
	Type    string   `json:"type"`
	DiffIDs []string `json:"diff_ids"`
}

type historyItem struct {
	Created   string `json:"created"`
	CreatedBy string `json:"created_by"`
}

type manifestEntry struct {
	Config   string
	RepoTags []string
	Layers   []string
}

// Write writes img as a docker-archive tarball to w. Each layer is read
// twice: once for its digest, once to copy it.
func Write(w io.Writer, img Image) error {
	if err := validName(img.Name); err != nil {
		return err
	}
	if len(img.Layers) == 0 {
		return errors.New("image " + img.Name + " has no layers")
	}
	arch := img.Arch
	if arch == "" {
		arch = runtime.GOARCH
	}
	cfg := config{
		Architecture: arch, OS: "linux", Created: epoch.Format(time.RFC3339),
		Config: runConfig{Entrypoint: img.Entrypoint, Cmd: img.Cmd, Env: img.Env, WorkingDir: img.WorkingDir},
		RootFS: rootFS{Type: "layers"},
	}
	var layerFiles []string
	for i, l := range img.Layers {
		id, err := DiffID(l)
		if err != nil {
			return fmt.Errorf("image %s layer %d: %w", img.Name, i, err)
		}
		cfg.RootFS.DiffIDs = append(cfg.RootFS.DiffIDs, id)
		cfg.History = append(cfg.History, historyItem{Created: cfg.Created, CreatedBy: fmt.Sprintf("imagearchive layer %d", i)})
		layerFiles = append(layerFiles, strings.TrimPrefix(id, "sha256:")+"/layer.tar")
	}
	cfgJSON, err := json.Marshal(cfg)
	if err != nil {
		return err
	}
	sum := sha256.Sum256(cfgJSON)
	cfgName := hex.EncodeToString(sum[:]) + ".json"
	man, err := json.Marshal([]manifestEntry{{Config: cfgName, RepoTags: []string{img.Name}, Layers: layerFiles}})
	if err != nil {
		return err
	}

	tw := tar.NewWriter(w)
	for i, l := range img.Layers {
		if slices.Index(layerFiles, layerFiles[i]) < i {
			continue // the same layer twice: stored once
		}
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: path.Dir(layerFiles[i]) + "/", Mode: 0o755, ModTime: epoch}); err != nil {
			return err
		}
		if err := copyLayer(tw, layerFiles[i], l); err != nil {
			return fmt.Errorf("image %s layer %d: %w", img.Name, i, err)
		}
	}
	for _, f := range []struct {
		name string
		data []byte
	}{{cfgName, cfgJSON}, {"manifest.json", man}} {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: f.name, Mode: 0o644, Size: int64(len(f.data)), ModTime: epoch}); err != nil {
			return err
		}
		if _, err := tw.Write(f.data); err != nil {
			return err
		}
	}
	return tw.Close()
}

func copyLayer(tw *tar.Writer, name string, l Layer) error {
	r, size, err := l.Open()
	if err != nil {
		return err
	}
	defer r.Close()
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: size, ModTime: epoch}); err != nil {
		return err
	}
	n, err := io.Copy(tw, r)
	if err != nil {
		return err
	}
	if n != size {
		return fmt.Errorf("layer changed while writing: %d bytes, expected %d", n, size)
	}
	return nil
}

// WriteFile writes img to a file atomically (a temporary file renamed).
func WriteFile(file string, img Image) error {
	tmp, err := os.CreateTemp(path.Dir(file), ".image-*.tar")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := Write(tmp, img); err != nil {
		_ = tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), file)
}

// validName wants registry/repository:tag with a registry part, so the
// runtime and a pod spec name the image the same way.
func validName(name string) error {
	slash := strings.IndexByte(name, '/')
	colon := strings.LastIndexByte(name, ':')
	if slash <= 0 || colon < slash || colon == len(name)-1 || strings.ContainsAny(name, " \t\n@") {
		return fmt.Errorf("image name %q: want a fully qualified registry/repository:tag", name)
	}
	if name != strings.ToLower(name[:colon])+name[colon:] {
		return fmt.Errorf("image name %q: repository must be lower case", name)
	}
	return nil
}
