package attest

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/static"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/sigstore/sigstore/pkg/cryptoutils"
	"github.com/sigstore/sigstore/pkg/signature"
	"github.com/sigstore/sigstore/pkg/signature/dsse"
)

// cosign's attachment layout: media types, annotations, tag suffixes and
// the simple-signing payload's type.
const (
	SimpleSigningMediaType  = "application/vnd.dev.cosign.simplesigning.v1+json"
	DSSEMediaType           = "application/vnd.dsse.envelope.v1+json"
	SignatureAnnotation     = "dev.cosignproject.cosign/signature"
	PredicateTypeAnnotation = "predicateType"
	SignatureSuffix         = "sig"
	AttestationSuffix       = "att"
	simpleSigningType       = "cosign container image signature"
)

// PasswordEnv holds the private key's password, as for cosign.
const PasswordEnv = "COSIGN_PASSWORD"

// GenerateKey returns a new ECDSA P-256 key pair as cosign writes one:
// the private key encrypted with password (PEM "ENCRYPTED SIGSTORE
// PRIVATE KEY"), the public key PKIX PEM.
func GenerateKey(password []byte) (priv, pub []byte, err error) {
	if password == nil {
		password = []byte{} // cosign's empty password; nil means none
	}
	return cryptoutils.GeneratePEMEncodedECDSAKeyPair(elliptic.P256(), cryptoutils.StaticPasswordFunc(password))
}

// LoadSigner reads a private key PEM (cosign's encrypted format, which
// password opens, or an unencrypted PKCS#8 or EC key) and refuses any
// key but ECDSA P-256.
func LoadSigner(pemBytes, password []byte) (signature.SignerVerifier, error) {
	if password == nil {
		password = []byte{}
	}
	k, err := cryptoutils.UnmarshalPEMToPrivateKey(pemBytes, cryptoutils.StaticPasswordFunc(password))
	if err != nil {
		return nil, fmt.Errorf("the signing key: %w", err)
	}
	ec, ok := k.(*ecdsa.PrivateKey)
	if !ok || ec.Curve != elliptic.P256() {
		return nil, fmt.Errorf("the signing key is a %T, want ECDSA P-256", k)
	}
	return signature.LoadECDSASignerVerifier(ec, crypto.SHA256)
}

// LoadVerifier reads a public key PEM and refuses any key but ECDSA P-256.
func LoadVerifier(pemBytes []byte) (signature.Verifier, error) {
	k, err := cryptoutils.UnmarshalPEMToPublicKey(pemBytes)
	if err != nil {
		return nil, fmt.Errorf("the public key: %w", err)
	}
	ec, ok := k.(*ecdsa.PublicKey)
	if !ok || ec.Curve != elliptic.P256() {
		return nil, fmt.Errorf("the public key is a %T, want ECDSA P-256", k)
	}
	return signature.LoadECDSAVerifier(ec, crypto.SHA256)
}

// PublicPEM returns a signer's public key as PEM.
func PublicPEM(s signature.Signer) ([]byte, error) {
	pub, err := s.PublicKey()
	if err != nil {
		return nil, err
	}
	return cryptoutils.MarshalPublicKeyToPEM(pub)
}

// simpleSigning is cosign's payload (Red Hat's simple signing format):
// what a signature says it signs.
type simpleSigning struct {
	Critical struct {
		Identity struct {
			DockerReference string `json:"docker-reference"`
		} `json:"identity"`
		Image struct {
			DockerManifestDigest string `json:"docker-manifest-digest"`
		} `json:"image"`
		Type string `json:"type"`
	} `json:"critical"`
	Optional map[string]any `json:"optional"`
}

// AttachmentTag is where cosign keeps an artifact's signatures (suffix
// "sig") or attestations ("att"): REPO:sha256-HEX.SUFFIX.
func AttachmentTag(d name.Digest, suffix string) (name.Tag, error) {
	h, err := v1.NewHash(d.DigestStr())
	if err != nil {
		return name.Tag{}, err
	}
	return d.Context().Tag(h.Algorithm + "-" + h.Hex + "." + suffix), nil
}

// attachment is the image cosign writes under an attachment tag: an OCI
// manifest of one uncompressed layer per signature or envelope.
func attachment(layers []mutate.Addendum) (v1.Image, error) {
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	return mutate.Append(img, layers...)
}

// Sign signs the artifact at d (an image index, or a chart's manifest) as
// cosign sign --key does and writes the signature to d's repository under
// its .sig tag, replacing what was there.
func Sign(ctx context.Context, d name.Digest, s signature.Signer, opts ...remote.Option) error {
	var p simpleSigning
	p.Critical.Identity.DockerReference = d.Context().Name()
	p.Critical.Image.DockerManifestDigest = d.DigestStr()
	p.Critical.Type = simpleSigningType
	payload, err := json.Marshal(p)
	if err != nil {
		return err
	}
	sig, err := s.SignMessage(bytes.NewReader(payload))
	if err != nil {
		return fmt.Errorf("sign %s: %w", d, err)
	}
	img, err := attachment([]mutate.Addendum{{
		Layer:       static.NewLayer(payload, SimpleSigningMediaType),
		Annotations: map[string]string{SignatureAnnotation: base64.StdEncoding.EncodeToString(sig)},
	}})
	if err != nil {
		return err
	}
	return write(ctx, d, SignatureSuffix, img, opts)
}

// Attest wraps each in-toto statement (JSON) in a DSSE envelope signed
// with s, as cosign attest --key does, and writes them all to d's
// repository under its .att tag, replacing what was there.
func Attest(ctx context.Context, d name.Digest, s signature.Signer, statements [][]byte, opts ...remote.Option) error {
	ds := dsse.WrapSigner(s, InTotoPayloadType)
	var layers []mutate.Addendum
	for _, st := range statements {
		parsed, err := ParseStatement(st)
		if err != nil {
			return err
		}
		env, err := ds.SignMessage(bytes.NewReader(st))
		if err != nil {
			return fmt.Errorf("sign the %s statement: %w", parsed.GetPredicateType(), err)
		}
		layers = append(layers, mutate.Addendum{
			Layer: static.NewLayer(env, DSSEMediaType),
			// cosign writes the signature annotation empty: the
			// envelope carries it.
			Annotations: map[string]string{SignatureAnnotation: "", PredicateTypeAnnotation: parsed.GetPredicateType()},
		})
	}
	if len(layers) == 0 {
		return errors.New("no statements to attest")
	}
	img, err := attachment(layers)
	if err != nil {
		return err
	}
	return write(ctx, d, AttestationSuffix, img, opts)
}

func write(ctx context.Context, d name.Digest, suffix string, img v1.Image, opts []remote.Option) error {
	tag, err := AttachmentTag(d, suffix)
	if err != nil {
		return err
	}
	if err := remote.Write(tag, img, append([]remote.Option{remote.WithContext(ctx)}, opts...)...); err != nil {
		return fmt.Errorf("push %s: %w", tag, err)
	}
	return nil
}

// SBOMStatement returns the in-toto statement of an SPDX SBOM about the
// image name at digest (cosign attest --type spdxjson's).
func SBOMStatement(name string, digest v1.Hash, sbom []byte) ([]byte, error) {
	if !strings.Contains(string(sbom), `"spdxVersion"`) {
		return nil, errors.New("the SBOM is not an SPDX JSON document")
	}
	return Statement(name, digest, SPDXPredicateType, sbom)
}
