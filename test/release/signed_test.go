package release

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"encoding/base64"
	"encoding/json"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	spdxjson "github.com/spdx/tools-golang/json"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
	"github.com/ambient-cni/ambient-cni/test/lib/kubeenv"
	"github.com/ambient-cni/ambient-cni/test/lib/sbomcheck"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// releasePubKey is the release's public key in the tree (the Makefile's
// RELEASE_PUBKEY).
const releasePubKey = "deploy/release/cosign.pub"

// keyPassword encrypts the test's release keys (COSIGN_PASSWORD).
const keyPassword = "release-test"

// releaseKey makes a release key pair as make release-key does (go run
// ./hack/release keygen), the private key in a temporary directory, and
// returns its path and the public key. Each run has keys of its own.
func releaseKey(t *testing.T) (key, pub string) {
	t.Helper()
	root, err := kubeenv.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("COSIGN_PASSWORD", keyPassword)
	dir := t.TempDir()
	key, pubPath := filepath.Join(dir, "cosign.key"), filepath.Join(dir, "cosign.pub")
	cmd := exec.Command("go", "run", "./hack/release", "keygen", "-private", key, "-pub", pubPath)
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("keygen: %v\n%s", err, out)
	}
	return key, read(t, pubPath)
}

// checkSBOM: the release's SBOM lists, for each image of the index, every
// module go version -m finds in each of the image's Go binaries and every
// package dpkg-query finds installed in that architecture's base.
func checkSBOM(t *testing.T, sbom []byte, layout string) {
	t.Helper()
	doc, err := spdxjson.Read(bytes.NewReader(sbom))
	if err != nil {
		t.Fatalf("the release's SBOM: %v", err)
	}
	idx, err := ociimage.ReadLayout(layout)
	if err != nil {
		t.Fatal(err)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	root, _ := kubeenv.RepoRoot()
	for _, m := range im.Manifests {
		arch := m.Platform.Architecture
		img, err := idx.Image(m.Digest)
		if err != nil {
			t.Fatal(err)
		}
		got := sbomcheck.ImageOf(doc, arch)
		bins := extract(t, img, slices.Collect(maps.Keys(ociimage.AgentFiles)))
		for path, bin := range bins {
			want, _ := sbomcheck.GoVersionM(t, bin)
			slices.Sort(want)
			if !slices.Equal(got.Binaries[path], want) {
				t.Errorf("%s %s: the SBOM lists %d modules, go version -m %d:\n  only in the SBOM: %v\n  only in go version -m: %v",
					arch, path, len(got.Binaries[path]), len(want), sbomcheck.Minus(got.Binaries[path], want), sbomcheck.Minus(want, got.Binaries[path]))
			}
		}
		if len(got.Binaries) != len(bins) {
			t.Errorf("%s: the SBOM lists the Go binaries %v, the image holds %d", arch, slices.Sorted(maps.Keys(got.Binaries)), len(bins))
		}
		out, err := exec.Command(filepath.Join(root, "hack", "kube-tools.sh"), "--path", "image-rootfs-"+arch).Output()
		if err != nil {
			t.Fatal(err)
		}
		installed := sbomcheck.DpkgInstalled(t, strings.TrimSpace(string(out)))
		if !slices.Equal(got.Debs, installed) || len(installed) < 50 {
			t.Errorf("%s: the SBOM lists %d Debian packages, dpkg-query %d installed in the base:\n  only in the SBOM: %v\n  only in dpkg-query: %v",
				arch, len(got.Debs), len(installed), sbomcheck.Minus(got.Debs, installed), sbomcheck.Minus(installed, got.Debs))
		}
		t.Logf("SBOM, %s: %d Go binaries, %d Debian packages, as go version -m and dpkg-query say", arch, len(bins), len(installed))
	}
}

// extract writes the image's files at paths (absolute) to a temporary
// directory and returns where each is.
func extract(t *testing.T, img v1.Image, paths []string) map[string]string {
	t.Helper()
	dir := t.TempDir()
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	out := map[string]string{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		p := "/" + strings.TrimPrefix(strings.TrimPrefix(h.Name, "./"), "/")
		if !slices.Contains(paths, p) {
			continue
		}
		f := filepath.Join(dir, strings.ReplaceAll(p, "/", "_"))
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		write(t, f, string(b))
		out[p] = f
	}
}

// alterChart returns the chart archive with its values.yaml's first line
// changed: the same chart name and version, other content.
func alterChart(t *testing.T, tgz []byte) []byte {
	t.Helper()
	zr, err := gzip.NewReader(bytes.NewReader(tgz))
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	tr, tw := tar.NewReader(zr), tar.NewWriter(zw)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasSuffix(h.Name, "/values.yaml") {
			b = append([]byte("# altered after signing\n"), b...)
			h.Size = int64(len(b))
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(b); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return out.Bytes()
}

// TestReleaseSigned cuts a release for this machine's architecture, makes
// its key as a maintainer would (make release-key, the public key
// committed), and checks what an installer relies on: make release-push
// refuses to push without the release key or with another key; with it,
// it signs the image and the chart and attaches the signed SBOM and
// provenance; make verify-release passes, and the SBOM lists every Go
// module and Debian package of the pushed image. Then it changes the
// release in the registry, one way at a time, and make verify-release
// refuses each: another image under the release's tag, another chart
// under its version (pushed by helm), an altered SBOM; and a public key
// other than the release's. Putting back what was released verifies
// again. It builds a release (a minute or more), so it runs with
// AMBIENT_TEST_RELEASE=1 (make test-release).
func TestReleaseSigned(t *testing.T) {
	if os.Getenv("AMBIENT_TEST_RELEASE") == "" {
		t.Skip("builds a release; AMBIENT_TEST_RELEASE=1 runs it (make test-release)")
	}
	if _, err := exec.LookPath("make"); err != nil {
		testnet.Missing(t, "needs make")
	}
	registry := startRegistry(t) + "/ambient-test"
	key, pub := releaseKey(t)
	otherKey, otherPub := releaseKey(t)
	src := sourceTree(t, testVersion, map[string]string{releasePubKey: pub})
	arch := runtime.GOARCH
	out, err := makeRelease(t, src, "release", "REGISTRY="+registry, "IMAGE_ARCHES="+arch, "PLUGIN_PLATFORMS=linux/"+arch)
	if err != nil {
		t.Fatalf("make release: %v\n%s", err, out)
	}
	dir := filepath.Join(src, "bin", "release", testVersion)
	rel := files(t, dir)
	for _, n := range []string{"sbom.spdx.json", "provenance.intoto.json"} {
		if rel[n] == nil {
			t.Fatalf("the release has no %s", n)
		}
	}
	checkSums(t, rel)
	checkSBOM(t, rel["sbom.spdx.json"], filepath.Join(dir, "image"))

	imageTag, err := name.NewTag(registry + "/ambient-cni:" + testVersion)
	if err != nil {
		t.Fatal(err)
	}
	push := []string{"release-push", "REGISTRY=" + registry, "PLAIN_HTTP=1"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{push, "SIGNING_KEY=path is needed"},
		{append(push, "SIGNING_KEY="+otherKey), "is not the key of " + releasePubKey},
	} {
		out, err := makeRelease(t, src, c.args...)
		if err == nil || !strings.Contains(out, c.want) {
			t.Errorf("make %s: %v, want refused with %q:\n%s", strings.Join(c.args, " "), err, c.want, out)
		}
		if _, err := remote.Head(imageTag); err == nil {
			t.Fatalf("make %s pushed the image before refusing", strings.Join(c.args, " "))
		}
	}
	out, err = makeRelease(t, src, append(push, "SIGNING_KEY="+key)...)
	if err != nil {
		t.Fatalf("make release-push: %v\n%s", err, out)
	}
	t.Logf("make release-push:\n%s", out)

	idx, err := ociimage.ReadLayout(filepath.Join(dir, "image"))
	if err != nil {
		t.Fatal(err)
	}
	digest, _ := idx.Digest()
	verify := func(args ...string) (string, error) {
		return makeRelease(t, src, append([]string{"verify-release", "REGISTRY=" + registry, "PLAIN_HTTP=1"}, args...)...)
	}
	mustVerify := func(what string) {
		t.Helper()
		out, err := verify()
		if err != nil || !strings.Contains(out, "image "+registry+"/ambient-cni@"+digest.String()) {
			t.Fatalf("%s: make verify-release: %v\n%s", what, err, out)
		}
		if !strings.Contains(out, "https://slsa.dev/provenance/v1") || !strings.Contains(out, "https://spdx.dev/Document") {
			t.Fatalf("%s: make verify-release did not check the SBOM and provenance:\n%s", what, out)
		}
	}
	mustVerify("the pushed release")
	refused := func(what, want string, args ...string) {
		t.Helper()
		out, err := verify(args...)
		if err == nil || !strings.Contains(out, want) {
			t.Errorf("%s: make verify-release: %v, want refused with %q:\n%s", what, err, want, out)
		} else {
			t.Logf("%s: refused", what)
		}
	}

	otherPubPath := filepath.Join(t.TempDir(), "other.pub")
	write(t, otherPubPath, otherPub)
	refused("another public key", "does not verify with the key", "RELEASE_PUBKEY="+otherPubPath)

	// Another image under the release's tag; then the release's again.
	bad, err := random.Index(256, 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(imageTag, bad); err != nil {
		t.Fatal(err)
	}
	refused("another image under the release's tag", "has no signature")
	if _, err := ociimage.Push(filepath.Join(dir, "image"), imageTag); err != nil {
		t.Fatal(err)
	}
	mustVerify("the release's image pushed back")

	// Another chart under the release's version, pushed by helm; then the
	// release's archive again (the same bytes give the same manifest).
	tgzName := "ambient-cni-" + testVersion + ".tgz"
	altered := filepath.Join(t.TempDir(), tgzName)
	write(t, altered, string(alterChart(t, rel[tgzName])))
	helm(t, "push", altered, "oci://"+registry+"/charts", "--plain-http")
	refused("another chart under the release's version", "has no signature")
	helm(t, "push", filepath.Join(dir, tgzName), "oci://"+registry+"/charts", "--plain-http")
	mustVerify("the release's chart pushed back")

	// An altered SBOM: one package's version changed in the signed
	// statement, the signature kept.
	d := imageTag.Context().Digest(digest.String())
	attTag := d.Context().Tag("sha256-" + digest.Hex + ".att")
	att, err := remote.Image(attTag)
	if err != nil {
		t.Fatal(err)
	}
	m, err := att.Manifest()
	if err != nil {
		t.Fatal(err)
	}
	tampered := mutate.ConfigMediaType(mutate.MediaType(empty.Image, types.OCIManifestSchema1), types.OCIConfigJSON)
	for _, l := range m.Layers {
		layer, err := att.LayerByDigest(l.Digest)
		if err != nil {
			t.Fatal(err)
		}
		rc, err := layer.Compressed()
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		if l.Annotations["predicateType"] == "https://spdx.dev/Document" {
			var env map[string]any
			if err := json.Unmarshal(b, &env); err != nil {
				t.Fatal(err)
			}
			p, _ := base64.StdEncoding.DecodeString(env["payload"].(string))
			p = bytes.Replace(p, []byte(`"name": "iptables"`), []byte(`"name": "iptables-patched"`), 1)
			env["payload"] = base64.StdEncoding.EncodeToString(p)
			b, _ = json.Marshal(env)
		}
		if tampered, err = mutate.Append(tampered, mutate.Addendum{Layer: static.NewLayer(b, l.MediaType), Annotations: l.Annotations}); err != nil {
			t.Fatal(err)
		}
	}
	if err := remote.Write(attTag, tampered); err != nil {
		t.Fatal(err)
	}
	refused("an altered SBOM", "does not verify with the key")
	if err := remote.Write(attTag, att); err != nil {
		t.Fatal(err)
	}
	mustVerify("the release's attestations pushed back")
}
