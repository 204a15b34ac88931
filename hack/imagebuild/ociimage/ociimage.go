// Package ociimage builds the agent's container image without Docker: for
// each architecture, a Debian base layer (a root filesystem tarball made
// by mmdebstrap, hack/kube-tools.sh image-rootfs-ARCH) and one layer of the
// shipped binaries, under one OCI image index, written as an OCI image
// layout directory that can be pushed as it is.
//
// Builds are reproducible: the same inputs give the same index digest.
// Every layer is rewritten with its entries sorted by name, one fixed
// modification time, no user or group names, and the agent's files owned
// by uid and gid 0; the config carries no build time.
package ociimage

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// The image's layout of the agent's files: the chart's image.command,
// image.pluginBinary (AMBIENT_PLUGIN_BINARY) and image.uninstallCommand.
// deploy/Dockerfile copies the same files to the same paths.
const (
	AgentCommand     = "/usr/local/bin/install-cni"
	PluginBinary     = "/opt/ambient-cni/bin/ambient-cni"
	UninstallCommand = "/usr/local/bin/ambient-cni-uninstall"
	// FallbackBinary is the plugin's second tier, beside it; the agent
	// copies it into its state dir.
	FallbackBinary = "/opt/ambient-cni/bin/ambient-cni-fallback"
)

// AgentFiles maps each of the agent's files in the image to the binary's
// name in a build directory (what go build -o DIR/ writes).
var AgentFiles = map[string]string{
	AgentCommand:     "install-cni",
	PluginBinary:     "ambient-cni",
	UninstallCommand: "ambient-cni-uninstall",
	FallbackBinary:   "ambient-cni-fallback",
}

// Epoch is the one modification time of every entry.
var Epoch = time.Unix(0, 0).UTC()

// Label keys of the OCI image spec's pre-defined annotations, set as
// image config labels and as annotations of the index.
const (
	LabelVersion  = "org.opencontainers.image.version"
	LabelRevision = "org.opencontainers.image.revision"
	LabelSource   = "org.opencontainers.image.source"
	LabelTitle    = "org.opencontainers.image.title"
	LabelDesc     = "org.opencontainers.image.description"
	// RefName names the index inside the layout (oci:DIR:TAG).
	RefName = "org.opencontainers.image.ref.name"
)

// Platform is one architecture's inputs.
type Platform struct {
	// Arch is the Go (and OCI) architecture: amd64, arm64.
	Arch string
	// Rootfs is the Debian base, a tar of a root filesystem.
	Rootfs string
	// BinDir holds this architecture's binaries named as in AgentFiles.
	BinDir string
}

// Spec is what to build.
type Spec struct {
	Platforms []Platform
	// Version and Revision (the git commit) become labels; Version also
	// names the index in the layout.
	Version, Revision string
	// Source is the repository's URL (label org.opencontainers.image.source).
	Source string
}

// Labels are the image config's labels and the index's annotations.
func (s Spec) Labels() map[string]string {
	return map[string]string{
		LabelVersion: s.Version, LabelRevision: s.Revision, LabelSource: s.Source,
		LabelTitle: "ambient-cni",
		LabelDesc:  "ambient-cni node agent (install-cni), its CNI plugin and uninstall hook, with iptables, nftables and ipset",
	}
}

// Build returns the image index of all platforms, in the order given.
func Build(s Spec) (v1.ImageIndex, error) {
	if len(s.Platforms) == 0 {
		return nil, errors.New("no platforms")
	}
	if s.Version == "" {
		return nil, errors.New("no version")
	}
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	idx = mutate.Annotations(idx, s.Labels()).(v1.ImageIndex)
	for _, p := range s.Platforms {
		img, err := buildImage(s, p)
		if err != nil {
			return nil, fmt.Errorf("%s image: %w", p.Arch, err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{
			Platform: &v1.Platform{OS: "linux", Architecture: p.Arch, Variant: variant(p.Arch)},
		}})
	}
	return idx, nil
}

// variant is the platform variant the OCI image index spec expects for
// an architecture (arm64 images say v8).
func variant(arch string) string {
	if arch == "arm64" {
		return "v8"
	}
	return ""
}

func buildImage(s Spec, p Platform) (v1.Image, error) {
	base, err := BaseLayer(p.Rootfs)
	if err != nil {
		return nil, fmt.Errorf("base %s: %w", p.Rootfs, err)
	}
	var files []File
	for dst, name := range AgentFiles {
		files = append(files, File{Path: dst, Mode: 0o755, Source: filepath.Join(p.BinDir, name)})
	}
	top, err := FilesLayer(files...)
	if err != nil {
		return nil, err
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	created := v1.Time{Time: Epoch}
	img, err = mutate.Append(img,
		mutate.Addendum{Layer: base, MediaType: types.OCILayer, History: v1.History{Created: created, CreatedBy: "Debian base (hack/kube-tools.sh image-rootfs-" + p.Arch + ")"}},
		mutate.Addendum{Layer: top, MediaType: types.OCILayer, History: v1.History{Created: created, CreatedBy: "ambient-cni binaries"}})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Architecture, cf.OS, cf.Variant = p.Arch, "linux", variant(p.Arch)
	cf.Created = created
	cf.Config.Entrypoint = []string{AgentCommand}
	cf.Config.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
	// Root by design (capabilities are limited by the DaemonSet).
	cf.Config.User = "0:0"
	cf.Config.Labels = s.Labels()
	return mutate.ConfigFile(img, cf)
}

// WriteLayout writes idx as an OCI image layout in dir (replaced whole),
// the index named by its version.
func WriteLayout(dir string, idx v1.ImageIndex, version string) error {
	tmp := dir + ".tmp"
	if err := os.RemoveAll(tmp); err != nil {
		return err
	}
	p, err := layout.Write(tmp, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendIndex(idx, layout.WithAnnotations(map[string]string{RefName: version})); err != nil {
		return err
	}
	if err := os.RemoveAll(dir); err != nil {
		return err
	}
	return os.Rename(tmp, dir)
}

// ReadLayout returns the image index a layout written by WriteLayout holds.
func ReadLayout(dir string) (v1.ImageIndex, error) {
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, err
	}
	outer, err := p.ImageIndex()
	if err != nil {
		return nil, err
	}
	m, err := outer.IndexManifest()
	if err != nil {
		return nil, err
	}
	if len(m.Manifests) != 1 || m.Manifests[0].MediaType != types.OCIImageIndex {
		return nil, fmt.Errorf("layout %s: want one image index, have %d entries", dir, len(m.Manifests))
	}
	return outer.ImageIndex(m.Manifests[0].Digest)
}

// Push writes the image index a layout written by WriteLayout holds, and
// every image and layer in it, to ref, and returns the index digest: what
// a runtime pulls by digest.
func Push(dir string, ref name.Reference, opts ...remote.Option) (v1.Hash, error) {
	idx, err := ReadLayout(dir)
	if err != nil {
		return v1.Hash{}, err
	}
	if err := remote.WriteIndex(ref, idx, opts...); err != nil {
		return v1.Hash{}, fmt.Errorf("push %s: %w", ref, err)
	}
	return idx.Digest()
}

// File is one regular file of a FilesLayer.
type File struct {
	// Path inside the image, absolute or relative to its root.
	Path string
	// Mode holds the permission bits (0o755 for a binary; 0 means 0o644).
	Mode os.FileMode
	// Source is a file on the host to copy, or Data the content.
	Source string
	Data   []byte
}

// FilesLayer builds a layer of files owned by root; the directories above
// them are added (0755). Entries are sorted and carry Epoch, so the same
// files give the same layer digest.
func FilesLayer(files ...File) (v1.Layer, error) {
	dirs := map[string]bool{}
	byName := map[string]File{}
	for _, f := range files {
		name := strings.TrimPrefix(path.Clean("/"+f.Path), "/")
		if name == "" {
			return nil, fmt.Errorf("file %q: empty path", f.Path)
		}
		if _, dup := byName[name]; dup {
			return nil, fmt.Errorf("file %q given twice", f.Path)
		}
		if f.Source != "" && f.Data != nil {
			return nil, fmt.Errorf("file %q: both Source and Data set", f.Path)
		}
		byName[name] = f
		for d := path.Dir(name); d != "."; d = path.Dir(d) {
			dirs[d] = true
		}
	}
	var entries []entry
	for d := range dirs {
		entries = append(entries, entry{hdr: &tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755}})
	}
	for name, f := range byName {
		data := f.Data
		if f.Source != "" {
			var err error
			if data, err = os.ReadFile(f.Source); err != nil {
				return nil, fmt.Errorf("file %q: %w", f.Path, err)
			}
		}
		mode := f.Mode.Perm()
		if mode == 0 {
			mode = 0o644
		}
		entries = append(entries, entry{hdr: &tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: int64(mode), Size: int64(len(data))}, data: data})
	}
	return layerOf(entries)
}

// BaseLayer reads a root filesystem tarball (mmdebstrap's) and returns it
// as a reproducible layer: entries sorted (hard links after the files they
// name), times set to Epoch, owner names dropped (numeric ids kept), and
// /dev left empty (the runtime mounts its own).
func BaseLayer(rootfs string) (v1.Layer, error) {
	f, err := os.Open(rootfs)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	tr := tar.NewReader(f)
	var entries []entry
	seen := map[string]bool{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		name := cleanName(h.Name)
		if name == "" {
			continue // the root itself
		}
		if strings.HasPrefix(name, "dev/") {
			continue
		}
		if seen[name] {
			return nil, fmt.Errorf("%s twice in %s", name, rootfs)
		}
		seen[name] = true
		switch h.Typeflag {
		case tar.TypeReg, tar.TypeDir, tar.TypeSymlink, tar.TypeLink:
		default:
			return nil, fmt.Errorf("%s: unexpected entry type %q", name, h.Typeflag)
		}
		nh := &tar.Header{Typeflag: h.Typeflag, Name: name, Linkname: h.Linkname, Mode: h.Mode, Uid: h.Uid, Gid: h.Gid, Size: h.Size, PAXRecords: xattrs(h.PAXRecords)}
		if h.Typeflag == tar.TypeDir {
			nh.Name += "/"
		}
		if h.Typeflag == tar.TypeLink {
			nh.Linkname = cleanName(h.Linkname)
		}
		var data []byte
		if h.Typeflag == tar.TypeReg {
			if data, err = io.ReadAll(tr); err != nil {
				return nil, err
			}
		}
		entries = append(entries, entry{hdr: nh, data: data})
	}
	return layerOf(entries)
}

// xattrs keeps the extended attributes of an entry (file capabilities),
// nothing else of its PAX records.
func xattrs(recs map[string]string) map[string]string {
	var out map[string]string
	for k, v := range recs {
		if strings.HasPrefix(k, "SCHILY.xattr.") {
			if out == nil {
				out = map[string]string{}
			}
			out[k] = v
		}
	}
	return out
}

func cleanName(n string) string {
	n = strings.TrimPrefix(path.Clean("/"+n), "/")
	if n == "." {
		return ""
	}
	return n
}

type entry struct {
	hdr  *tar.Header
	data []byte
}

// layerOf writes the entries sorted (hard links last, so their targets
// come first), each at Epoch, as one uncompressed tar, and returns it as
// a gzip-compressed OCI layer.
func layerOf(entries []entry) (v1.Layer, error) {
	slices.SortFunc(entries, func(a, b entry) int {
		if la, lb := a.hdr.Typeflag == tar.TypeLink, b.hdr.Typeflag == tar.TypeLink; la != lb {
			if la {
				return 1
			}
			return -1
		}
		return strings.Compare(a.hdr.Name, b.hdr.Name)
	})
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		e.hdr.ModTime = Epoch
		e.hdr.Format = tar.FormatPAX
		if err := tw.WriteHeader(e.hdr); err != nil {
			return nil, fmt.Errorf("%s: %w", e.hdr.Name, err)
		}
		if _, err := tw.Write(e.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	b := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil },
		tarball.WithMediaType(types.OCILayer))
}
