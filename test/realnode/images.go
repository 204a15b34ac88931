package realnode

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
	"github.com/ambient-cni/ambient-cni/test/realnode/imagearchive"
)

// Images are the node's images: the agent's in the node's registry, the
// others imported into containerd, by full name.
type Images struct {
	// Agent is the DaemonSet image, by digest in the node's registry:
	// make image's files (static install-cni and plugin on Debian
	// bookworm with iptables, nftables and ipset).
	Agent string
	// Registry is the node's loopback registry (host:port).
	Registry string
	// Pause is the sandbox image, App the test application, StandIn the
	// ztunnel stand-in.
	Pause, App, StandIn string

	archives []string
	// agentLayout is the agent's OCI image layout (make image's output);
	// digests the index digest pushed under each tag.
	agentLayout string
	digests     map[string]string
	// key signs what is pushed and verifies it before an install
	// (signing.go); chartTgz is the chart archive pushed.
	key      *releaseKey
	chartTgz []byte
}

// ImageRepository and ImageTag name the local test images: fully
// qualified, so the runtime never tries a registry, and pulled Never.
// ImageTag is also the agent image's first tag in the node's registry.
const (
	ImageRepository = "docker.io/local"
	ImageTag        = "dev"
)

func imageName(name string) string { return ImageRepository + "/" + name + ":" + ImageTag }

// ImageCache holds the images BuildImages built once, for every node a
// process starts: the images come from the same checkout, so compiling
// and linking the binaries and writing the layers again at each node's
// start (seven links and a compressed Debian layer) is CPU a busy CI
// spends for nothing. Its directory belongs to whoever made it.
type ImageCache struct {
	dir  string
	mu   sync.Mutex
	imgs *Images
}

// NewImageCache keeps the images it builds under dir.
func NewImageCache(dir string) *ImageCache { return &ImageCache{dir: dir} }

// build returns the images, built into the cache's directory the first
// time; a nil cache builds them into dir each time.
func (c *ImageCache) build(ctx context.Context, dir string, t Tools, logf func(string, ...any)) (Images, error) {
	if c == nil {
		return BuildImages(ctx, dir, t, logf)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.imgs == nil {
		imgs, err := BuildImages(ctx, c.dir, t, logf)
		if err != nil {
			return Images{}, err
		}
		c.imgs = &imgs
	} else {
		logf("   the images this process built before, in %s", c.dir)
	}
	imgs := *c.imgs
	imgs.archives = slices.Clone(imgs.archives)
	return imgs, nil
}

// BuildImages builds the binaries of every image from the repository
// (static, like make image), writes the agent's image as make image does
// (package ociimage: an OCI image index in an OCI layout, which Up pushes
// to the node's registry) and one image archive for each other image
// (which Up imports). The Debian base is the cached rootfs.
//
// The agent's index holds linux/amd64 only: make image's second
// architecture would add a cross-compile and a second base to every
// node's start for an image this node never runs (hack/imagebuild's tests
// build both and compare their files).
func BuildImages(ctx context.Context, dir string, t Tools, logf func(string, ...any)) (Images, error) {
	imgDir := filepath.Join(dir, "images")
	bin := filepath.Join(imgDir, "bin")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return Images{}, err
	}
	start := time.Now()
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin+"/",
		"./cmd/cni-plugin", "./cmd/ambient-cni-fallback", "./cmd/install-cni", "./cmd/ambient-cni-uninstall", "./test/lib/ztunnel/cmd/ztunnel-standin", "./test/realnode/cmd/app", "./test/realnode/cmd/pause")
	cmd.Dir = t.Repo
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return Images{}, fmt.Errorf("build image binaries: %w\n%s", err, out)
	}
	// go build names a binary after its main's directory; the plugin's is
	// cmd/cni-plugin, its binary ambient-cni (the name runtimes look up).
	if err := os.Rename(filepath.Join(bin, "cni-plugin"), filepath.Join(bin, "ambient-cni")); err != nil {
		return Images{}, fmt.Errorf("name the plugin binary: %w", err)
	}
	logf("   built install-cni, the plugin, the uninstall hook, the stand-in, app and pause (static) in %v", time.Since(start).Round(100*time.Millisecond))

	imgs := Images{Pause: imageName("pause"), App: imageName("app"), StandIn: imageName("ztunnel-standin"), agentLayout: filepath.Join(imgDir, "agent")}
	one := func(name string, entry []string, cmd []string, layers ...imagearchive.Layer) error {
		a := filepath.Join(imgDir, strings.NewReplacer("/", "_", ":", "_").Replace(name)+".tar")
		if err := imagearchive.WriteFile(a, imagearchive.Image{Name: name, Entrypoint: entry, Cmd: cmd, Layers: layers}); err != nil {
			return fmt.Errorf("write image %s: %w", name, err)
		}
		imgs.archives = append(imgs.archives, a)
		return nil
	}
	for _, b := range []string{"ambient-cni", "ambient-cni-fallback", "install-cni", "ambient-cni-uninstall", "ztunnel-standin", "app", "pause"} {
		if _, err := os.Stat(filepath.Join(bin, b)); err != nil {
			return Images{}, fmt.Errorf("image binary %s: %w", b, err)
		}
	}
	idx, err := ociimage.Build(ociimage.Spec{
		Platforms: []ociimage.Platform{{Arch: runtime.GOARCH, Rootfs: t.ImageRootfs, BinDir: bin}},
		Version:   ImageTag, Revision: "realnode", Source: "test/realnode",
	})
	if err != nil {
		return imgs, fmt.Errorf("build the agent image: %w", err)
	}
	if err := ociimage.WriteLayout(imgs.agentLayout, idx, ImageTag); err != nil {
		return imgs, fmt.Errorf("write the agent image layout: %w", err)
	}
	// The other images hold one static binary each, at the root.
	for _, single := range []struct{ name, bin string }{{imgs.Pause, "pause"}, {imgs.App, "app"}, {imgs.StandIn, "ztunnel-standin"}} {
		l, err := imagearchive.FilesLayer(imagearchive.File{Path: "/" + single.bin, Mode: 0o755, Source: filepath.Join(bin, single.bin)})
		if err != nil {
			return imgs, err
		}
		var cmd []string
		if single.bin == "app" {
			cmd = []string{"serve"}
		}
		if err := one(single.name, []string{"/" + single.bin}, cmd, l); err != nil {
			return imgs, err
		}
	}
	logf("   wrote the agent's OCI layout and 3 image archives in %v", time.Since(start).Round(100*time.Millisecond))
	return imgs, nil
}
