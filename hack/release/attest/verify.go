package attest

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	intoto "github.com/in-toto/attestation/go/v1"
	"github.com/sigstore/sigstore/pkg/signature"
	"github.com/sigstore/sigstore/pkg/signature/dsse"
)

// Resolve returns the digest ref names now (a tag's, as the registry
// serves it; a digest reference as it is).
func Resolve(ctx context.Context, ref name.Reference, opts ...remote.Option) (name.Digest, error) {
	if d, ok := ref.(name.Digest); ok {
		return d, nil
	}
	desc, err := remote.Get(ref, append([]remote.Option{remote.WithContext(ctx)}, opts...)...)
	if err != nil {
		return name.Digest{}, fmt.Errorf("resolve %s: %w", ref, err)
	}
	return ref.Context().Digest(desc.Digest.String()), nil
}

// attachmentImage returns the image under d's attachment tag, or an
// error saying d has none: the artifact was changed in the registry (a
// new digest has no signature) or never signed.
func attachmentImage(ctx context.Context, d name.Digest, suffix, what string, opts []remote.Option) (v1.Image, *v1.Manifest, error) {
	tag, err := AttachmentTag(d, suffix)
	if err != nil {
		return nil, nil, err
	}
	img, err := remote.Image(tag, append([]remote.Option{remote.WithContext(ctx)}, opts...)...)
	var terr *transport.Error
	if errors.As(err, &terr) && terr.StatusCode == http.StatusNotFound {
		return nil, nil, fmt.Errorf("%s has no %s (%s not found): it is not what was released, or was never signed", d, what, tag.TagStr())
	}
	if err != nil {
		return nil, nil, fmt.Errorf("fetch %s: %w", tag, err)
	}
	m, err := img.Manifest()
	if err != nil {
		return nil, nil, fmt.Errorf("%s: %w", tag, err)
	}
	if len(m.Layers) == 0 {
		return nil, nil, fmt.Errorf("%s: no %s in it", tag, what)
	}
	return img, m, nil
}

func layerBytes(img v1.Image, desc v1.Descriptor) ([]byte, error) {
	l, err := img.LayerByDigest(desc.Digest)
	if err != nil {
		return nil, err
	}
	rc, err := l.Compressed() // verified against its digest as it is read
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(io.LimitReader(rc, 64<<20))
}

// VerifySignature resolves ref and checks the signatures under its .sig
// tag, as cosign verify --key does: there must be one, and every one
// must verify with v and say it signs this digest in this repository. It
// returns the verified digest, the one to install by.
func VerifySignature(ctx context.Context, ref name.Reference, v signature.Verifier, opts ...remote.Option) (name.Digest, error) {
	d, err := Resolve(ctx, ref, opts...)
	if err != nil {
		return d, err
	}
	img, m, err := attachmentImage(ctx, d, SignatureSuffix, "signature", opts)
	if err != nil {
		return d, err
	}
	for i, l := range m.Layers {
		fail := func(format string, a ...any) error {
			return fmt.Errorf("%s: signature %d of %d refused: %s", d, i+1, len(m.Layers), fmt.Sprintf(format, a...))
		}
		if l.MediaType != SimpleSigningMediaType {
			return d, fail("media type %s, want %s", l.MediaType, SimpleSigningMediaType)
		}
		sig, err := base64.StdEncoding.DecodeString(l.Annotations[SignatureAnnotation])
		if err != nil || len(sig) == 0 {
			return d, fail("no signature annotation")
		}
		payload, err := layerBytes(img, l)
		if err != nil {
			return d, fail("%v", err)
		}
		if err := v.VerifySignature(bytes.NewReader(sig), bytes.NewReader(payload)); err != nil {
			return d, fail("does not verify with the key: %v", err)
		}
		var p simpleSigning
		if err := json.Unmarshal(payload, &p); err != nil {
			return d, fail("payload: %v", err)
		}
		if p.Critical.Type != simpleSigningType {
			return d, fail("payload type %q", p.Critical.Type)
		}
		if got := p.Critical.Image.DockerManifestDigest; got != d.DigestStr() {
			return d, fail("it signs %s, not this digest", got)
		}
		if got := p.Critical.Identity.DockerReference; got != d.Context().Name() {
			return d, fail("it signs %s in %s, not in this repository", d.DigestStr(), got)
		}
	}
	return d, nil
}

// VerifyAttestations checks the attestations under d's .att tag, as
// cosign verify-attestation --key does: every envelope must verify with
// v and hold an in-toto statement whose subject is d, and each predicate
// type of want must be there. It returns the statements by predicate
// type.
func VerifyAttestations(ctx context.Context, d name.Digest, v signature.Verifier, want []string, opts ...remote.Option) (map[string][]byte, error) {
	img, m, err := attachmentImage(ctx, d, AttestationSuffix, "attestation", opts)
	if err != nil {
		return nil, err
	}
	h, err := v1.NewHash(d.DigestStr())
	if err != nil {
		return nil, err
	}
	out := map[string][]byte{}
	for i, l := range m.Layers {
		fail := func(format string, a ...any) error {
			return fmt.Errorf("%s: attestation %d of %d (%s) refused: %s", d, i+1, len(m.Layers), l.Annotations[PredicateTypeAnnotation], fmt.Sprintf(format, a...))
		}
		if l.MediaType != DSSEMediaType {
			return nil, fail("media type %s, want %s", l.MediaType, DSSEMediaType)
		}
		env, err := layerBytes(img, l)
		if err != nil {
			return nil, fail("%v", err)
		}
		var payload []byte
		dv := dsse.WrapVerifier(v, dsse.WithExpectedPayloadType(InTotoPayloadType), dsse.WithDecodedPayload(&payload))
		if err := dv.VerifySignature(bytes.NewReader(env), nil); err != nil {
			return nil, fail("does not verify with the key: %v", err)
		}
		st, err := ParseStatement(payload)
		if err != nil {
			return nil, fail("%v", err)
		}
		if !slices.ContainsFunc(st.GetSubject(), func(s *intoto.ResourceDescriptor) bool {
			return s.GetDigest()[h.Algorithm] == h.Hex
		}) {
			return nil, fail("its subject is not %s", d.DigestStr())
		}
		if a := l.Annotations[PredicateTypeAnnotation]; a != "" && a != st.GetPredicateType() {
			return nil, fail("annotated %s, but the statement is %s", a, st.GetPredicateType())
		}
		out[st.GetPredicateType()] = payload
	}
	for _, w := range want {
		if _, ok := out[w]; !ok {
			return nil, fmt.Errorf("%s: no %s attestation", d, w)
		}
	}
	return out, nil
}

// HelmChartMediaType is the media type of a chart's archive in the OCI
// manifest helm push writes.
const HelmChartMediaType = "application/vnd.cncf.helm.chart.content.v1.tar+gzip"

// CheckChart fails unless the chart manifest at d holds exactly the
// archive tgz (helm push's config and annotations are helm's; the
// archive is the release's).
func CheckChart(ctx context.Context, d name.Digest, tgz []byte, opts ...remote.Option) error {
	desc, err := remote.Get(d, append([]remote.Option{remote.WithContext(ctx)}, opts...)...)
	if err != nil {
		return fmt.Errorf("fetch the chart %s: %w", d, err)
	}
	m, err := v1.ParseManifest(bytes.NewReader(desc.Manifest))
	if err != nil {
		return fmt.Errorf("the chart %s: %w", d, err)
	}
	want, _, err := v1.SHA256(bytes.NewReader(tgz))
	if err != nil {
		return err
	}
	for _, l := range m.Layers {
		if l.MediaType == HelmChartMediaType {
			if l.Digest != want {
				return fmt.Errorf("the chart %s holds the archive %s, not the release's %s", d, l.Digest, want)
			}
			return nil
		}
	}
	return fmt.Errorf("the chart %s has no %s layer", d, HelmChartMediaType)
}
