package attest

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"log"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/random"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/sigstore/sigstore/pkg/signature"
)

// loopbackRegistry serves an OCI registry (go-containerregistry's, in
// memory) on loopback and returns its host:port.
func loopbackRegistry(t *testing.T) string {
	t.Helper()
	s := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(s.Close)
	return strings.TrimPrefix(s.URL, "http://")
}

// chartArtifact is what helm push writes for a chart archive.
func chartArtifact(t *testing.T, tgz []byte) v1.Image {
	t.Helper()
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, "application/vnd.cncf.helm.config.v1+json")
	img, err := mutate.Append(img, mutate.Addendum{Layer: static.NewLayer(tgz, HelmChartMediaType)})
	if err != nil {
		t.Fatal(err)
	}
	return img
}

func newKey(t *testing.T) (signature.SignerVerifier, signature.Verifier) {
	t.Helper()
	priv, pub, err := GenerateKey([]byte("test-password"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(priv, []byte("ENCRYPTED SIGSTORE PRIVATE KEY")) {
		t.Fatalf("the private key is not in cosign's encrypted format:\n%s", priv)
	}
	if _, err := LoadSigner(priv, []byte("wrong")); err == nil {
		t.Fatal("the private key opened with a wrong password")
	}
	sv, err := LoadSigner(priv, []byte("test-password"))
	if err != nil {
		t.Fatal(err)
	}
	v, err := LoadVerifier(pub)
	if err != nil {
		t.Fatal(err)
	}
	return sv, v
}

// A release signed as make release-push signs it (the image index and
// the chart in cosign's .sig layout, the SBOM and provenance as DSSE
// attestations in .att) verifies with the public key, and each way of
// changing it in the registry is refused: another image or chart under
// the release's tag, an altered SBOM or provenance, a signature payload
// naming another digest, signatures by another key.
func TestSignedReleaseVerifiesAndTamperingIsRefused(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	host := loopbackRegistry(t)
	sv, v := newKey(t)
	other, _ := newKey(t)

	imageTag, err := name.NewTag(host + "/ambient-test/ambient-cni:0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	chartTag, err := name.NewTag(host + "/ambient-test/charts/ambient-cni:0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	idx, err := random.Index(256, 1, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(imageTag, idx); err != nil {
		t.Fatal(err)
	}
	h, _ := idx.Digest()
	img := imageTag.Context().Digest(h.String())
	tgz := []byte("the release's chart archive")
	chartImg := chartArtifact(t, tgz)
	if err := remote.Write(chartTag, chartImg); err != nil {
		t.Fatal(err)
	}
	ch, _ := chartImg.Digest()
	chart := chartTag.Context().Digest(ch.String())

	// Sign as release-push does.
	sbom, err := WriteSBOM(SBOM(SBOMInput{Name: img.Context().Name(), Version: "0.0.1", Index: h, Namespace: "https://example.invalid/x", Created: time.Unix(0, 0)}))
	if err != nil {
		t.Fatal(err)
	}
	sbomSt, err := SBOMStatement(img.Context().Name(), h, sbom)
	if err != nil {
		t.Fatal(err)
	}
	prov, err := Provenance(ProvenanceInput{
		Name: img.Context().Name(), Index: h, Version: "0.0.1", Registry: host + "/ambient-test",
		Source: "https://example.invalid/x", Commit: strings.Repeat("ab", 20), GoSum: []byte("go.sum"),
		GoVersion: "go1.26.8", Bases: map[string]string{"amd64": strings.Repeat("0", 64)},
		Platforms: map[string]v1.Hash{"amd64": h},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := Sign(ctx, img, sv); err != nil {
		t.Fatal(err)
	}
	if err := Attest(ctx, img, sv, [][]byte{sbomSt, prov}); err != nil {
		t.Fatal(err)
	}
	if err := CheckChart(ctx, chart, tgz); err != nil {
		t.Fatal(err)
	}
	if err := Sign(ctx, chart, sv); err != nil {
		t.Fatal(err)
	}

	want := []string{SPDXPredicateType, SLSAProvenanceV1}
	verify := func() error {
		d, err := VerifySignature(ctx, imageTag, v)
		if err != nil {
			return err
		}
		if d != img {
			t.Fatalf("the tag resolved to %s, want %s", d, img)
		}
		sts, err := VerifyAttestations(ctx, d, v, want)
		if err != nil {
			return err
		}
		if !bytes.Equal(sts[SLSAProvenanceV1], prov) {
			t.Fatal("the verified provenance is not the one attested")
		}
		c, err := VerifySignature(ctx, chartTag, v)
		if err != nil {
			return err
		}
		return CheckChart(ctx, c, tgz)
	}
	if err := verify(); err != nil {
		t.Fatalf("the signed release does not verify: %v", err)
	}
	if _, err := VerifySignature(ctx, imageTag, other); err == nil || !strings.Contains(err.Error(), "does not verify with the key") {
		t.Errorf("verified with another key: %v", err)
	}

	attachment := func(d name.Digest, suffix string) (name.Tag, v1.Image) {
		tag, err := AttachmentTag(d, suffix)
		if err != nil {
			t.Fatal(err)
		}
		im, err := remote.Image(tag)
		if err != nil {
			t.Fatal(err)
		}
		return tag, im
	}
	sigTag, sigImg := attachment(img, SignatureSuffix)
	attTag, attImg := attachment(img, AttestationSuffix)
	restore := func() {
		t.Helper()
		for tag, im := range map[name.Tag]v1.Image{sigTag: sigImg, attTag: attImg, chartTag: chartImg} {
			if err := remote.Write(tag, im); err != nil {
				t.Fatal(err)
			}
		}
		if err := remote.WriteIndex(imageTag, idx); err != nil {
			t.Fatal(err)
		}
		if err := verify(); err != nil {
			t.Fatalf("the restored release does not verify: %v", err)
		}
	}
	// rewriteAtt replaces the attestation of one predicate type with
	// change(envelope).
	rewriteAtt := func(pt string, change func(env map[string]any)) {
		t.Helper()
		m, _ := attImg.Manifest()
		var adds []mutate.Addendum
		for _, l := range m.Layers {
			b, err := layerBytes(attImg, l)
			if err != nil {
				t.Fatal(err)
			}
			if l.Annotations[PredicateTypeAnnotation] == pt {
				var env map[string]any
				if err := json.Unmarshal(b, &env); err != nil {
					t.Fatal(err)
				}
				change(env)
				b, _ = json.Marshal(env)
			}
			adds = append(adds, mutate.Addendum{Layer: static.NewLayer(b, l.MediaType), Annotations: l.Annotations})
		}
		im, err := attachmentImageOf(adds)
		if err != nil {
			t.Fatal(err)
		}
		if err := remote.Write(attTag, im); err != nil {
			t.Fatal(err)
		}
	}
	alterPayload := func(old, new string) func(map[string]any) {
		return func(env map[string]any) {
			p, _ := base64.StdEncoding.DecodeString(env["payload"].(string))
			if !bytes.Contains(p, []byte(old)) {
				t.Fatalf("the payload has no %q", old)
			}
			env["payload"] = base64.StdEncoding.EncodeToString(bytes.Replace(p, []byte(old), []byte(new), 1))
		}
	}

	for _, c := range []struct {
		name   string
		tamper func()
		want   string
	}{
		{"another image under the release's tag", func() {
			bad, _ := random.Index(256, 1, 2)
			if err := remote.WriteIndex(imageTag, bad); err != nil {
				t.Fatal(err)
			}
		}, "has no signature"},
		{"another chart under the release's tag", func() {
			if err := remote.Write(chartTag, chartArtifact(t, []byte("a changed chart"))); err != nil {
				t.Fatal(err)
			}
		}, "has no signature"},
		{"an altered SBOM", func() { rewriteAtt(SPDXPredicateType, alterPayload(`"SPDX-2.3"`, `"SPDX-2.2"`)) }, "does not verify with the key"},
		{"an altered provenance", func() {
			rewriteAtt(SLSAProvenanceV1, alterPayload(strings.Repeat("ab", 20), strings.Repeat("cd", 20)))
		}, "does not verify with the key"},
		{"the SBOM removed", func() {
			m, _ := attImg.Manifest()
			var adds []mutate.Addendum
			for _, l := range m.Layers {
				if l.Annotations[PredicateTypeAnnotation] != SPDXPredicateType {
					b, _ := layerBytes(attImg, l)
					adds = append(adds, mutate.Addendum{Layer: static.NewLayer(b, l.MediaType), Annotations: l.Annotations})
				}
			}
			im, _ := attachmentImageOf(adds)
			if err := remote.Write(attTag, im); err != nil {
				t.Fatal(err)
			}
		}, "no " + SPDXPredicateType + " attestation"},
		{"the image signed by another key", func() {
			if err := Sign(ctx, img, other); err != nil {
				t.Fatal(err)
			}
		}, "does not verify with the key"},
		{"the attestations signed by another key", func() {
			if err := Attest(ctx, img, other, [][]byte{sbomSt, prov}); err != nil {
				t.Fatal(err)
			}
		}, "does not verify with the key"},
		{"a signature payload naming another digest", func() {
			m, _ := sigImg.Manifest()
			p, _ := layerBytes(sigImg, m.Layers[0])
			p = bytes.Replace(p, []byte(h.Hex), []byte(strings.Repeat("0", 64)), 1)
			im, _ := attachmentImageOf([]mutate.Addendum{{Layer: static.NewLayer(p, SimpleSigningMediaType), Annotations: m.Layers[0].Annotations}})
			if err := remote.Write(sigTag, im); err != nil {
				t.Fatal(err)
			}
		}, "does not verify with the key"},
	} {
		c.tamper()
		err := verify()
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: verify: %v, want refused with %q", c.name, err, c.want)
		} else {
			t.Logf("%s: refused: %v", c.name, err)
		}
		restore()
	}
	if err := CheckChart(ctx, chart, []byte("another archive")); err == nil || !strings.Contains(err.Error(), "not the release's") {
		t.Errorf("CheckChart with another archive: %v", err)
	}
}

func attachmentImageOf(adds []mutate.Addendum) (v1.Image, error) { return attachment(adds) }
