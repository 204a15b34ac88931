package realnode

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
	"github.com/ambient-cni/ambient-cni/hack/release/attest"
	"github.com/ambient-cni/ambient-cni/test/lib/childproc"
)

// The node's registry: the CNCF distribution registry (hack/kube-tools.sh
// registry) on loopback, plain HTTP, its storage in the node directory. The
// agent's image and the chart are pushed to it as make image-push and make
// chart-push push them, containerd pulls the image by digest and helm
// installs the chart with helm install oci://, as on a cluster.

// Repositories in the node's registry: the agent's image, and the chart
// under charts/ (helm push oci://REGISTRY/charts names it after the chart,
// as make chart-push does).
const (
	agentRepoName = "ambient-cni"
	chartRepoPath = "charts"
)

// ChartVersion is the version the chart is packaged with: what make chart
// makes of the version ImageTag (0.0.0-VERSION for a VERSION that is not
// a v-tag), with appVersion ImageTag.
const ChartVersion = "0.0.0-" + ImageTag

// Registry is the node's loopback registry, host:port.
func (n *Node) Registry() string { return n.Images.Registry }

// AgentRepository is the agent image's repository in the node's registry
// (chart value image.repository).
func (n *Node) AgentRepository() string { return n.Images.Registry + "/" + agentRepoName }

// ChartRef is the chart in the node's registry, as helm install takes it.
func (n *Node) ChartRef() string {
	return "oci://" + n.Images.Registry + "/" + chartRepoPath + "/" + Release
}

// AgentDigest is the digest the agent image was pushed with under tag,
// empty if none was.
func (n *Node) AgentDigest(tag string) string { return n.Images.digests[tag] }

// AgentImage is the image reference the chart renders for tag: by digest
// when tag was pushed, else by the tag alone (which the registry does not
// have: the pull fails).
func (n *Node) AgentImage(tag string) string {
	if d := n.AgentDigest(tag); d != "" {
		return n.AgentRepository() + "@" + d
	}
	return n.AgentRepository() + ":" + tag
}

// registryConfig is the registry's configuration: loopback only, storage
// in dir, the access log on (tests read who pulled what from it), no
// background upload purging.
func registryConfig(addr, dir string) string {
	return fmt.Sprintf(`version: 0.1
log:
  level: info
  formatter: text
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: %s
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: %s
`, strconv.Quote(dir), strconv.Quote(addr))
}

// startRegistry starts the registry on a free loopback port and waits
// until its API answers; hosts.toml tells containerd to pull from it over
// plain HTTP.
func (n *Node) startRegistry(ctx context.Context) error {
	dir := filepath.Join(n.Dir, "registry")
	if err := os.MkdirAll(filepath.Join(dir, "storage"), 0o755); err != nil {
		return err
	}
	ports, err := freePorts(1)
	if err != nil {
		return err
	}
	n.Images.Registry = "127.0.0.1:" + strconv.Itoa(ports[0])
	cfg := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfg, []byte(registryConfig(n.Images.Registry, filepath.Join(dir, "storage"))), 0o600); err != nil {
		return err
	}
	// No trace exporter: its default sends to an OTLP collector.
	env := []string{"OTEL_TRACES_EXPORTER=none", "OTEL_SDK_DISABLED=true"}
	p, err := childproc.Start("registry", n.Tools.Registry, []string{"serve", cfg}, env, filepath.Join(n.Dir, "registry.log"))
	if err != nil {
		return err
	}
	n.procs = append(n.procs, p)
	if err := n.poll(ctx, "registry", n.opts.Wait, func(ctx context.Context) (bool, error) {
		_, err := httpGet(ctx, "http://"+n.Images.Registry+"/v2/")
		return err == nil, err
	}); err != nil {
		return err
	}
	return n.writeHostsToml()
}

// registryHostsDir is containerd's registry config_path: one directory
// per registry host, each with a hosts.toml.
func (n *Node) registryHostsDir() string { return filepath.Join(n.Dir, "containerd", "certs.d") }

// writeHostsToml says that the node's registry speaks plain HTTP, so
// containerd pulls from it without trying TLS first.
func (n *Node) writeHostsToml() error {
	d := filepath.Join(n.registryHostsDir(), n.Images.Registry)
	if err := os.MkdirAll(d, 0o755); err != nil {
		return err
	}
	u := strconv.Quote("http://" + n.Images.Registry)
	toml := fmt.Sprintf("server = %s\n\n[host.%s]\n  capabilities = [\"pull\", \"resolve\"]\n", u, u)
	return os.WriteFile(filepath.Join(d, "hosts.toml"), []byte(toml), 0o644)
}

// pushAgent pushes the agent's image index (the OCI layout BuildImages
// wrote, as make image does) under tag, as make image-push does, and
// records its digest. Any tag but ImageTag gets an image of its own: the
// same layers, its version label and index annotation set to tag, so a
// helm upgrade to it rolls the DaemonSet to a new digest as a release
// does.
func (n *Node) pushAgent(ctx context.Context, tag string) (string, error) {
	start := time.Now()
	ref, err := name.NewTag(n.AgentRepository()+":"+tag, name.Insecure)
	if err != nil {
		return "", err
	}
	var d v1.Hash
	idx, err := ociimage.ReadLayout(n.Images.agentLayout)
	if err == nil {
		if tag == ImageTag {
			d, err = ociimage.Push(n.Images.agentLayout, ref, remote.WithContext(ctx))
		} else if idx, err = relabel(idx, tag); err == nil {
			if err = remote.WriteIndex(ref, idx, remote.WithContext(ctx)); err == nil {
				d, err = idx.Digest()
			}
		}
	}
	if err != nil {
		return "", fmt.Errorf("push the agent image as %s: %w", ref, err)
	}
	if err := n.signAgent(ctx, ref.Context().Digest(d.String()), idx, tag); err != nil {
		return "", fmt.Errorf("sign the agent image %s: %w", ref, err)
	}
	if n.Images.digests == nil {
		n.Images.digests = map[string]string{}
	}
	n.Images.digests[tag] = d.String()
	n.logf("   pushed and signed %s@%s, its SBOM and provenance in %v", ref, d, time.Since(start).Round(10*time.Millisecond))
	return d.String(), nil
}

// PushAgentTag pushes the agent's image as a new release tagged tag (a
// new digest, the same files) and returns its digest: what an upgrade
// test rolls the DaemonSet to.
func (n *Node) PushAgentTag(ctx context.Context, tag string) (string, error) {
	return n.pushAgent(ctx, tag)
}

// relabel returns idx with every image's version label and the index's
// version annotation set to version.
func relabel(idx v1.ImageIndex, version string) (v1.ImageIndex, error) {
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, err
	}
	ann := map[string]string{}
	for k, v := range m.Annotations {
		ann[k] = v
	}
	ann[ociimage.LabelVersion] = version
	out := mutate.Annotations(mutate.IndexMediaType(empty.Index, types.OCIImageIndex), ann).(v1.ImageIndex)
	for _, desc := range m.Manifests {
		img, err := idx.Image(desc.Digest)
		if err != nil {
			return nil, err
		}
		cf, err := img.ConfigFile()
		if err != nil {
			return nil, err
		}
		cf = cf.DeepCopy()
		cf.Config.Labels[ociimage.LabelVersion] = version
		if img, err = mutate.ConfigFile(img, cf); err != nil {
			return nil, err
		}
		out = mutate.AppendManifests(out, mutate.IndexAddendum{Add: img, Descriptor: v1.Descriptor{Platform: desc.Platform}})
	}
	return out, nil
}

// pushChart packages the chart as make chart does (version ChartVersion,
// appVersion ImageTag), pushes it as make chart-push does, to
// oci://REGISTRY/charts, and signs it as make release-push does.
func (n *Node) pushChart(ctx context.Context) error {
	start := time.Now()
	out := filepath.Join(n.Dir, "images", "chart")
	if _, err := n.Helm(ctx, "package", ChartDir, "--version", ChartVersion, "--app-version", ImageTag, "-d", out); err != nil {
		return err
	}
	tgz := filepath.Join(out, Release+"-"+ChartVersion+".tgz")
	if _, err := n.Helm(ctx, "push", tgz, "oci://"+n.Images.Registry+"/"+chartRepoPath, "--plain-http"); err != nil {
		return err
	}
	b, err := os.ReadFile(tgz)
	if err != nil {
		return err
	}
	if err := n.signChart(ctx, b); err != nil {
		return fmt.Errorf("sign the chart: %w", err)
	}
	n.logf("   pushed and signed the chart %s --version %s in %v", n.ChartRef(), ChartVersion, time.Since(start).Round(10*time.Millisecond))
	return nil
}

// accessLine matches a request line of the registry's access log (the
// Apache combined format): method, path, status and user agent.
var accessLine = regexp.MustCompile(`"(GET|HEAD) (/v2/[^ ]+) HTTP/[0-9.]+" ([0-9]{3}) [0-9-]+ "[^"]*" "([^"]*)"`)

// RegistryPulls returns the registry's successful requests of path (e.g.
// /v2/ambient-cni/manifests/sha256:...), GET or HEAD (a client resolves a
// reference with HEAD, then fetches by digest), each as the user agent
// that made it.
func (n *Node) RegistryPulls(path string) ([]string, error) {
	b, err := os.ReadFile(filepath.Join(n.Dir, "registry.log"))
	if err != nil {
		return nil, err
	}
	var agents []string
	for _, m := range accessLine.FindAllStringSubmatch(string(b), -1) {
		if m[2] == path && m[3] == "200" {
			agents = append(agents, m[4])
		}
	}
	return agents, nil
}

// CheckAgentFromRegistry proves that the installed agent came from the
// node's registry: its pod runs the pushed digest (spec and imageID),
// containerd asked the registry for that manifest and holds the image
// under that digest, and helm's release is the packaged chart, which helm
// asked the registry for.
func (n *Node) CheckAgentFromRegistry(ctx context.Context) error {
	d := n.AgentDigest(ImageTag)
	if d == "" {
		return fmt.Errorf("no digest pushed for %s", ImageTag)
	}
	want := n.AgentRepository() + "@" + d
	pods, err := n.AgentPods(ctx)
	if err != nil || len(pods) != 1 {
		return fmt.Errorf("%d agent pods (%v)", len(pods), err)
	}
	p := pods[0]
	if img := p.Spec.Containers[0].Image; img != want {
		return fmt.Errorf("agent pod image %s, want %s", img, want)
	}
	if len(p.Status.ContainerStatuses) != 1 || p.Status.ContainerStatuses[0].ImageID != want {
		return fmt.Errorf("agent pod imageID %+v, want %s", p.Status.ContainerStatuses, want)
	}
	agents, err := n.RegistryPulls("/v2/" + agentRepoName + "/manifests/" + d)
	if err != nil {
		return err
	}
	if !hasPrefixed(agents, "containerd/") {
		return fmt.Errorf("the registry's log has no request of the agent's manifest %s by containerd (user agents: %v)", d, agents)
	}
	out, err := n.crictl(ctx, "images", "--digests", "-o", "json")
	if err != nil {
		return err
	}
	var imgs struct {
		Images []struct{ RepoDigests []string }
	}
	if err := json.Unmarshal([]byte(out), &imgs); err != nil {
		return fmt.Errorf("crictl images: %w", err)
	}
	held := false
	for _, i := range imgs.Images {
		for _, rd := range i.RepoDigests {
			held = held || rd == want
		}
	}
	if !held {
		return fmt.Errorf("containerd holds no image %s (crictl images: %s)", want, out)
	}
	meta, err := n.Helm(ctx, "get", "metadata", Release, "--namespace", ReleaseNamespace, "-o", "json")
	if err != nil {
		return err
	}
	var rel struct {
		Version    string `json:"version"`
		AppVersion string `json:"appVersion"`
	}
	if err := json.Unmarshal([]byte(meta), &rel); err != nil {
		return fmt.Errorf("helm get metadata: %w: %s", err, meta)
	}
	if rel.Version != ChartVersion || rel.AppVersion != ImageTag {
		return fmt.Errorf("release chart %s (appVersion %s), want the pushed %s (%s)", rel.Version, rel.AppVersion, ChartVersion, ImageTag)
	}
	// Installed by the digest verified (signing.go): the tag's.
	tag, err := n.chartTag()
	if err != nil {
		return err
	}
	cd, err := attest.Resolve(ctx, tag, remote.WithContext(ctx))
	if err != nil {
		return err
	}
	chart := cd.DigestStr()
	agents, err = n.RegistryPulls("/v2/" + chartRepoPath + "/" + Release + "/manifests/" + chart)
	if err != nil {
		return err
	}
	if !hasPrefixed(agents, "Helm/") {
		return fmt.Errorf("the registry's log has no request of the chart %s@%s by helm (user agents: %v)", chartRepoPath+"/"+Release, chart, agents)
	}
	return nil
}

func hasPrefixed(l []string, prefix string) bool {
	for _, s := range l {
		if strings.HasPrefix(s, prefix) {
			return true
		}
	}
	return false
}
