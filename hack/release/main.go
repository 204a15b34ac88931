// Command release holds the steps of make release that are more than a
// build (hack/release.sh runs them; docs/release.md):
//
//	release check -version V -changelog CHANGELOG.md
//	release stamp-chart -src CHART -out DIR -layout IMAGE -repository REPO
//	release assemble -version V -dir RELEASE -chart TGZ -plugins DIR -helm HELM -epoch SECONDS ...
//	release check-push -dir RELEASE -registry REGISTRY
//	release check-key -key SIGNING_KEY -pub PUBLIC_KEY
//	release sign -dir RELEASE -registry REGISTRY -key SIGNING_KEY -pub PUBLIC_KEY
//	release verify -image REF -chart REF -key PUBLIC_KEY [-chart-archive TGZ]
//	release keygen -private PATH -pub PUBLIC_KEY
//
// check refuses a version that is not SemVer and a CHANGELOG without the
// version's section, before anything is built. stamp-chart copies the
// chart with its default image set to the release's repository and the
// image index's digest. assemble writes the release directory: the
// chart's archive made reproducible, the plain manifest rendered from it,
// the kubectl plugin's archives and their krew manifest, the image's SBOM
// and the release's provenance, the release notes and SHA256SUMS.
// check-push refuses to push a release to a registry other than the one
// its chart and manifest name. check-key refuses a signing key whose
// public half is not the release's; sign signs a pushed release (image,
// chart, SBOM, provenance: package attest) and verifies it; verify checks
// a pushed release before an install; keygen makes a release key pair.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "make release:", err)
		os.Exit(1)
	}
}

// Names in a release directory.
const (
	ImageDir     = "image"
	ManifestName = "ambient-cni.yaml"
	KrewName     = "kubectl-ambient_cni.krew.yaml"
	NotesName    = "RELEASE_NOTES.md"
	// AgentRepo is the image's repository under REGISTRY (make image-push).
	AgentRepo = "ambient-cni"
	// The plain manifest's release and namespace, as deploy/manifests'.
	releaseName = "ambient-cni"
	namespace   = "istio-system"
)

// ChartName is the chart's archive in a release directory (make chart's).
func ChartName(version string) string { return "ambient-cni-" + version + ".tgz" }

func run(args []string) error {
	if len(args) == 0 {
		return errors.New("usage: release check|stamp-chart|assemble|check-push|check-key|sign|verify|keygen [flags]")
	}
	fs := flag.NewFlagSet("release "+args[0], flag.ContinueOnError)
	switch args[0] {
	case "check":
		version := fs.String("version", "", "the release's version (the VERSION file)")
		changelog := fs.String("changelog", "CHANGELOG.md", "the changelog")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if err := CheckVersion(*version); err != nil {
			return err
		}
		b, err := os.ReadFile(*changelog)
		if err != nil {
			return err
		}
		_, err = Notes(b, *version)
		return err
	case "stamp-chart":
		src := fs.String("src", "", "the chart's directory")
		out := fs.String("out", "", "directory to copy it into (replaced)")
		layout := fs.String("layout", "", "the release's image, an OCI layout (make image)")
		repo := fs.String("repository", "", "the image's repository: REGISTRY/ambient-cni")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		d, err := indexDigest(*layout)
		if err != nil {
			return err
		}
		return stampChart(*src, *out, *repo, d)
	case "assemble":
		var a assembly
		fs.StringVar(&a.version, "version", "", "the release's version")
		fs.StringVar(&a.dir, "dir", "", "the release directory (holds image/ already)")
		fs.StringVar(&a.chart, "chart", "", "the stamped chart packaged by make chart")
		fs.StringVar(&a.plugins, "plugins", "", "directory of make kubectl-plugins' kubectl-OS-ARCH/ directories")
		fs.StringVar(&a.helm, "helm", "", "the helm binary")
		fs.StringVar(&a.registry, "registry", "", "REGISTRY the release is for")
		fs.StringVar(&a.url, "url", "", "where the plugin's archives are downloaded from (krew's uri)")
		fs.StringVar(&a.homepage, "homepage", "", "the project's URL")
		fs.StringVar(&a.commit, "commit", "", "the released commit")
		fs.StringVar(&a.changelog, "changelog", "CHANGELOG.md", "the changelog")
		fs.StringVar(&a.gosum, "gosum", "go.sum", "the go.sum the binaries were built with (the provenance records its digest)")
		a.bases = archFlag{}
		fs.Var(a.bases, "base", "ARCH=PATH: an architecture's Debian base tarball (repeated; the provenance records their digests)")
		platforms := fs.String("platforms", strings.Join(pluginPlatforms, " "), "the kubectl plugin's platforms (PLUGIN_PLATFORMS)")
		epoch := fs.Int64("epoch", -1, "the time of every archive entry (SOURCE_DATE_EPOCH)")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		if *epoch < 0 {
			return errors.New("assemble: -epoch is required")
		}
		a.mtime = time.Unix(*epoch, 0).UTC()
		a.platforms = strings.Fields(*platforms)
		return a.run()
	case "check-push":
		dir := fs.String("dir", "", "the release directory")
		registry := fs.String("registry", "", "where make release-push pushes")
		if err := fs.Parse(args[1:]); err != nil {
			return err
		}
		return checkPush(*dir, *registry)
	case "check-key", "sign", "verify", "keygen":
		return runSigning(args[0], fs, args[1:])
	}
	return fmt.Errorf("unknown command %q", args[0])
}

func indexDigest(layout string) (string, error) {
	idx, err := ociimage.ReadLayout(layout)
	if err != nil {
		return "", fmt.Errorf("the image %s: %w", layout, err)
	}
	d, err := idx.Digest()
	if err != nil {
		return "", err
	}
	return d.String(), nil
}

// stampChart copies the chart src to out/NAME with its default image the
// release's: values.yaml's image.repository and image.digest.
func stampChart(src, out, repo, digest string) error {
	dst := filepath.Join(out, filepath.Base(src))
	if err := os.RemoveAll(out); err != nil {
		return err
	}
	if err := os.CopyFS(dst, os.DirFS(src)); err != nil {
		return fmt.Errorf("copy the chart: %w", err)
	}
	vf := filepath.Join(dst, "values.yaml")
	b, err := os.ReadFile(vf)
	if err != nil {
		return err
	}
	if b, err = StampValues(b, repo, digest); err != nil {
		return err
	}
	return os.WriteFile(vf, b, 0o644)
}

type assembly struct {
	version, dir, chart, plugins, helm, registry, url, homepage, commit, changelog, gosum string
	bases                                                                                 archFlag
	platforms                                                                             []string
	mtime                                                                                 time.Time
}

// pluginPlatforms are the kubectl plugin's builds (make kubectl-plugins's
// PLUGIN_PLATFORMS), assemble's default.
var pluginPlatforms = []string{"darwin/amd64", "darwin/arm64", "linux/amd64", "linux/arm64"}

func (a assembly) run() error {
	idx, d, err := readIndex(filepath.Join(a.dir, ImageDir))
	if err != nil {
		return err
	}
	digest := d.String()
	image := a.registry + "/" + AgentRepo + "@" + digest

	// The chart, reproducible; its file time is helm push's "created".
	tgz, err := os.ReadFile(a.chart)
	if err != nil {
		return err
	}
	if tgz, err = NormalizeChart(tgz, a.mtime); err != nil {
		return fmt.Errorf("%s: %w", a.chart, err)
	}
	chart := filepath.Join(a.dir, ChartName(a.version))
	if err := a.write(chart, tgz); err != nil {
		return err
	}

	// The plain manifest: the release's chart with its defaults.
	m, err := a.render(chart)
	if err != nil {
		return err
	}
	if err := CheckManifestImage(m, image); err != nil {
		return err
	}
	header := fmt.Sprintf(`# ambient-cni %s: the release's chart (%s) rendered with its default
# values as release %q in namespace %q; the agent's image by digest:
#   %s
# Written by "make release"; do not edit.
# The namespace must exist: kubectl create namespace %s
# helm's uninstall hook is left out: to uninstall, first
#   kubectl -n %s delete service %s-installed
#   kubectl -n %s delete daemonset %s --cascade=foreground --wait
# so the agents release the pods they captured, then delete the rest.
`, a.version, ChartName(a.version), releaseName, namespace, image, namespace, namespace, releaseName, namespace, releaseName)
	if err := a.write(filepath.Join(a.dir, ManifestName), append([]byte(header), m...)); err != nil {
		return err
	}

	// The kubectl plugin's archives and their krew manifest.
	archives := map[string][]byte{}
	for _, p := range a.platforms {
		goos, goarch, _ := strings.Cut(p, "/")
		bin, err := os.ReadFile(filepath.Join(a.plugins, "kubectl-"+goos+"-"+goarch, PluginBinary))
		if err != nil {
			return fmt.Errorf("the kubectl plugin for %s: %w", p, err)
		}
		if archives[p], err = Archive(PluginBinary, bin, a.mtime); err != nil {
			return err
		}
		if err := a.write(filepath.Join(a.dir, PluginArchiveName(a.version, goos, goarch)), archives[p]); err != nil {
			return err
		}
	}
	krew, err := KrewManifest(a.version, a.url, a.homepage, archives)
	if err != nil {
		return err
	}
	if err := a.write(filepath.Join(a.dir, KrewName), krew); err != nil {
		return err
	}

	// The image's SBOM and the release's provenance.
	if err := a.attestations(idx, d); err != nil {
		return err
	}

	// The notes: what the release is, then CHANGELOG's section.
	cl, err := os.ReadFile(a.changelog)
	if err != nil {
		return err
	}
	body, err := Notes(cl, a.version)
	if err != nil {
		return err
	}
	notes := fmt.Sprintf("# ambient-cni %s\n\n"+
		"- Image: `%s` (linux/amd64, linux/arm64; tag `%s`)\n"+
		"- Chart: `oci://%s/charts/ambient-cni`, version `%s` (its default image is the digest above)\n"+
		"- Manifest: `%s` (the chart rendered with its defaults)\n"+
		"- kubectl plugin: `%s` per platform, krew manifest `%s`\n"+
		"- Commit: `%s`; checksums: `%s`\n\n%s\n",
		a.version, image, a.version, a.registry, a.version, ManifestName,
		PluginArchiveName(a.version, "OS", "ARCH"), KrewName, a.commit, SumsName, body)
	if err := a.write(filepath.Join(a.dir, NotesName), []byte(notes)); err != nil {
		return err
	}

	sums, err := Sums(a.dir)
	if err != nil {
		return err
	}
	if err := a.write(filepath.Join(a.dir, SumsName), sums); err != nil {
		return err
	}
	fmt.Printf("release %s in %s\n  image %s\n  chart %s\n", a.version, a.dir, image, ChartName(a.version))
	return nil
}

// write writes a release file at the release's time (helm push takes
// the chart's "created" annotation from its archive's mtime).
func (a assembly) write(path string, b []byte) error {
	if err := os.WriteFile(path, b, 0o644); err != nil {
		return err
	}
	return os.Chtimes(path, a.mtime, a.mtime)
}

// render runs helm template on the chart archive with its defaults, as
// make manifests renders the source tree's chart, with helm's cache and
// config in a temporary directory so no user setting changes the output.
func (a assembly) render(chart string) ([]byte, error) {
	home, err := os.MkdirTemp("", "release-helm-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(home)
	cmd := exec.Command(a.helm, "template", releaseName, chart, "--namespace", namespace, "--no-hooks")
	cmd.Env = append(os.Environ(),
		"HELM_CACHE_HOME="+filepath.Join(home, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(home, "config"),
		"HELM_DATA_HOME="+filepath.Join(home, "data"),
		"KUBECONFIG="+filepath.Join(home, "no-kubeconfig"))
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("helm template %s: %w: %s", chart, err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}

var imageLine = regexp.MustCompile(`(?m)^\s*image:\s*"?([^"\s]+)"?\s*$`)

// CheckManifestImage fails unless every image a manifest names is image.
func CheckManifestImage(m []byte, image string) error {
	all := imageLine.FindAllSubmatch(m, -1)
	if len(all) == 0 {
		return errors.New("the manifest names no image")
	}
	for _, s := range all {
		if string(s[1]) != image {
			return fmt.Errorf("the manifest names the image %s, want %s", s[1], image)
		}
	}
	return nil
}

// checkPush refuses a registry the release was not built for: its chart
// and manifest name their image there by digest.
func checkPush(dir, registry string) error {
	m, err := os.ReadFile(filepath.Join(dir, ManifestName))
	if err != nil {
		return fmt.Errorf("%w (run make release first)", err)
	}
	s := imageLine.FindSubmatch(m)
	if s == nil {
		return fmt.Errorf("%s names no image", ManifestName)
	}
	want, _, _ := strings.Cut(string(s[1]), "@")
	if got := registry + "/" + AgentRepo; got != want {
		return fmt.Errorf("this release's chart and manifest name the image %s: push it to REGISTRY=%s, or make release again with REGISTRY=%s", want, strings.TrimSuffix(want, "/"+AgentRepo), registry)
	}
	return nil
}
