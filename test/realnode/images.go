package realnode

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
	"github.com/ambient-cni/ambient-cni/test/realnode/imagearchive"
)

// Images are the node's local images, by full name.
type Images struct {
	// Agent is the DaemonSet image: deploy/Dockerfile's contents (static
	// install-cni and plugin on Debian bookworm with iptables, nftables
	// and ipset).
	Agent string
	// Pause is the sandbox image, App the test application, StandIn the
	// ztunnel stand-in.
	Pause, App, StandIn string

	archives []string
}

// ImageRepository and ImageTag name the local images: fully qualified, so
// the runtime never tries a registry, and pulled Never.
const (
	ImageRepository = "docker.io/local"
	ImageTag        = "dev"
)

func imageName(name string) string { return ImageRepository + "/" + name + ":" + ImageTag }

// AgentRepository is the DaemonSet image's repository (chart value
// image.repository).
const AgentRepository = ImageRepository + "/ambient-cni"

// The DaemonSet image layout, as make image and deploy/Dockerfile build
// it (the chart's image.command, image.pluginBinary and
// image.uninstallCommand).
const (
	agentCommand     = ociimage.AgentCommand
	pluginBinary     = ociimage.PluginBinary
	uninstallCommand = ociimage.UninstallCommand
)

// BuildImages builds the binaries of every image from the repository
// (static, like deploy/Dockerfile), and writes one image archive each
// under dir; Up imports them. The Debian base is the cached rootfs.
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

	imgs := Images{Agent: imageName("ambient-cni"), Pause: imageName("pause"), App: imageName("app"), StandIn: imageName("ztunnel-standin")}
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
	agentTop, err := imagearchive.FilesLayer(
		imagearchive.File{Path: agentCommand, Mode: 0o755, Source: filepath.Join(bin, "install-cni")},
		imagearchive.File{Path: pluginBinary, Mode: 0o755, Source: filepath.Join(bin, "ambient-cni")},
		imagearchive.File{Path: filepath.Join(filepath.Dir(pluginBinary), "ambient-cni-fallback"), Mode: 0o755, Source: filepath.Join(bin, "ambient-cni-fallback")},
		imagearchive.File{Path: uninstallCommand, Mode: 0o755, Source: filepath.Join(bin, "ambient-cni-uninstall")},
	)
	if err != nil {
		return imgs, err
	}
	if err := one(imgs.Agent, []string{agentCommand}, nil, imagearchive.FileLayer(t.Rootfs), agentTop); err != nil {
		return imgs, err
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
	logf("   wrote 4 image archives in %v", time.Since(start).Round(100*time.Millisecond))
	return imgs, nil
}
