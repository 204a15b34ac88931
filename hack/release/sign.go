package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/sigstore/sigstore/pkg/cryptoutils"
	"github.com/sigstore/sigstore/pkg/signature"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
	"github.com/ambient-cni/ambient-cni/hack/release/attest"
)

// Names in a release directory: the image's SBOM and the release's
// provenance, made by assemble (unsigned, reproducible); release-push
// signs them and attaches them to the image.
const (
	SBOMName       = "sbom.spdx.json"
	ProvenanceName = "provenance.intoto.json"
	// ChartRepo is the chart's repository under REGISTRY (make chart-push).
	ChartRepo = "charts/ambient-cni"
)

// attestations writes the SBOM of the release's image index and the
// release's provenance into the release directory.
func (a assembly) attestations(idx v1.ImageIndex, digest v1.Hash) error {
	cs, plat, goVersion, err := attest.IndexContents(idx)
	if err != nil {
		return err
	}
	in := attest.SBOMInput{
		Name: a.registry + "/" + AgentRepo, Version: a.version, Index: digest,
		Namespace: a.homepage, Created: a.mtime, Platforms: cs,
	}
	sbom, err := attest.WriteSBOM(attest.SBOM(in))
	if err != nil {
		return err
	}
	if err := a.write(filepath.Join(a.dir, SBOMName), sbom); err != nil {
		return err
	}
	bases := map[string]string{}
	for arch, p := range a.bases {
		if bases[arch], err = attest.FileSHA256(p); err != nil {
			return fmt.Errorf("the %s base: %w", arch, err)
		}
	}
	gosum, err := os.ReadFile(a.gosum)
	if err != nil {
		return err
	}
	prov, err := attest.Provenance(attest.ProvenanceInput{
		Name: in.Name, Index: digest, Version: a.version, Registry: a.registry,
		Source: a.homepage, Commit: a.commit, GoSum: gosum, GoVersion: goVersion,
		Bases: bases, Platforms: plat,
	})
	if err != nil {
		return err
	}
	return a.write(filepath.Join(a.dir, ProvenanceName), prov)
}

// archFlag collects -base ARCH=PATH.
type archFlag map[string]string

func (f archFlag) String() string { return fmt.Sprint(map[string]string(f)) }
func (f archFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" || v == "" {
		return fmt.Errorf("%q: want ARCH=PATH", s)
	}
	f[k] = v
	return nil
}

// signingKey loads the private key at path (its password in
// COSIGN_PASSWORD) and refuses it unless its public half is the one in
// pub: what verifiers will check with.
func signingKey(path, pub string) (signature.SignerVerifier, error) {
	if path == "" {
		return nil, errors.New("SIGNING_KEY=path is needed: the release key's private half (docs/release.md#signing); a release is signed when it is pushed")
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("SIGNING_KEY: %w", err)
	}
	sv, err := attest.LoadSigner(b, []byte(os.Getenv(attest.PasswordEnv)))
	if err != nil {
		return nil, fmt.Errorf("SIGNING_KEY %s: %w (its password is read from %s)", path, err, attest.PasswordEnv)
	}
	pb, err := os.ReadFile(pub)
	if err != nil {
		return nil, fmt.Errorf("the release's public key: %w (make release-key writes it; commit it)", err)
	}
	want, err := cryptoutils.UnmarshalPEMToPublicKey(pb)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", pub, err)
	}
	got, err := sv.PublicKey()
	if err != nil {
		return nil, err
	}
	if err := cryptoutils.EqualKeys(want, got); err != nil {
		return nil, fmt.Errorf("SIGNING_KEY %s is not the key of %s: verifiers would refuse what it signs", path, pub)
	}
	return sv, nil
}

func remoteOpts() []remote.Option {
	return []remote.Option{remote.WithAuthFromKeychain(authn.DefaultKeychain)}
}

func parseRef(s string, plainHTTP bool) (name.Reference, error) {
	var opts []name.Option
	if plainHTTP {
		opts = append(opts, name.Insecure)
	}
	return name.ParseReference(s, opts...)
}

// signRelease signs a pushed release: the image index and the chart as
// pushed (the chart's manifest checked to hold the release's archive
// first), and attaches the signed SBOM and provenance to the index; then
// verifies it all with the public key, as an installer would.
func signRelease(ctx context.Context, dir, registry, key, pub string, plainHTTP bool) error {
	sv, err := signingKey(key, pub)
	if err != nil {
		return err
	}
	digest, err := indexDigest(filepath.Join(dir, ImageDir))
	if err != nil {
		return err
	}
	ref, err := parseRef(registry+"/"+AgentRepo+"@"+digest, plainHTTP)
	if err != nil {
		return err
	}
	img := ref.(name.Digest)
	if _, err := remote.Head(img, append(remoteOpts(), remote.WithContext(ctx))...); err != nil {
		return fmt.Errorf("the release's image is not in the registry (make release-push pushes it first): %w", err)
	}
	if err := attest.Sign(ctx, img, sv, remoteOpts()...); err != nil {
		return err
	}
	h, err := v1.NewHash(digest)
	if err != nil {
		return err
	}
	var statements [][]byte
	sbom, err := os.ReadFile(filepath.Join(dir, SBOMName))
	if err != nil {
		return err
	}
	st, err := attest.SBOMStatement(img.Context().Name(), h, sbom)
	if err != nil {
		return err
	}
	statements = append(statements, st)
	prov, err := os.ReadFile(filepath.Join(dir, ProvenanceName))
	if err != nil {
		return err
	}
	statements = append(statements, prov)
	if err := attest.Attest(ctx, img, sv, statements, remoteOpts()...); err != nil {
		return err
	}

	version, tgz, err := releaseChart(dir)
	if err != nil {
		return err
	}
	chartRef, err := parseRef(registry+"/"+ChartRepo+":"+strings.ReplaceAll(version, "+", "_"), plainHTTP)
	if err != nil {
		return err
	}
	chart, err := attest.Resolve(ctx, chartRef, remoteOpts()...)
	if err != nil {
		return err
	}
	if err := attest.CheckChart(ctx, chart, tgz, remoteOpts()...); err != nil {
		return err
	}
	if err := attest.Sign(ctx, chart, sv, remoteOpts()...); err != nil {
		return err
	}
	fmt.Printf("signed %s, its SBOM and provenance\nsigned %s\n", img, chart)
	return verifyRelease(ctx, img, chartRef, tgz, pub)
}

// releaseChart returns the version and archive of a release directory's chart.
func releaseChart(dir string) (string, []byte, error) {
	m, err := filepath.Glob(filepath.Join(dir, "ambient-cni-*.tgz"))
	if err != nil || len(m) != 1 {
		return "", nil, fmt.Errorf("%s: want one chart archive, found %v", dir, m)
	}
	b, err := os.ReadFile(m[0])
	v := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(m[0]), "ambient-cni-"), ".tgz")
	return v, b, err
}

// verifyRelease checks a pushed release with the public key pub, as
// before an install: the image's signature and its SBOM and provenance
// attestations, and the chart's signature (and, given tgz, that it holds
// that archive). It prints what to install by digest.
func verifyRelease(ctx context.Context, image, chart name.Reference, tgz []byte, pub string) error {
	pb, err := os.ReadFile(pub)
	if err != nil {
		return fmt.Errorf("the public key: %w", err)
	}
	v, err := attest.LoadVerifier(pb)
	if err != nil {
		return err
	}
	img, err := attest.VerifySignature(ctx, image, v, remoteOpts()...)
	if err != nil {
		return fmt.Errorf("the image: %w", err)
	}
	sts, err := attest.VerifyAttestations(ctx, img, v, []string{attest.SPDXPredicateType, attest.SLSAProvenanceV1}, remoteOpts()...)
	if err != nil {
		return fmt.Errorf("the image's attestations: %w", err)
	}
	c, err := attest.VerifySignature(ctx, chart, v, remoteOpts()...)
	if err != nil {
		return fmt.Errorf("the chart: %w", err)
	}
	if tgz != nil {
		if err := attest.CheckChart(ctx, c, tgz, remoteOpts()...); err != nil {
			return err
		}
	}
	fmt.Printf("verified with %s:\n  image %s (signature; attestations %s)\n  chart %s (signature)\n",
		pub, img, strings.Join(slices.Sorted(maps.Keys(sts)), ", "), c)
	return nil
}

// keygen writes a new release key pair: the private key, encrypted with
// COSIGN_PASSWORD, to a path outside the source tree (it is never
// committed), the public key into it.
func keygen(private, public string) error {
	if private == "" || public == "" {
		return errors.New("keygen: SIGNING_KEY=path (outside the tree) and the public key's path are needed")
	}
	root, err := os.Getwd()
	if err != nil {
		return err
	}
	abs, err := filepath.Abs(private)
	if err != nil {
		return err
	}
	if rel, err := filepath.Rel(root, abs); err == nil && !strings.HasPrefix(rel, "..") {
		return fmt.Errorf("SIGNING_KEY=%s is inside the source tree: keep the private key outside it (docs/release.md#signing)", private)
	}
	for _, p := range []string{private, public} {
		if _, err := os.Stat(p); err == nil {
			return fmt.Errorf("%s exists: not replacing a key", p)
		}
	}
	pw := os.Getenv(attest.PasswordEnv)
	if pw == "" {
		fmt.Fprintf(os.Stderr, "keygen: %s is empty: the private key is encrypted with an empty password\n", attest.PasswordEnv)
	}
	priv, pubPEM, err := attest.GenerateKey([]byte(pw))
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(public), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(private, priv, 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(public, pubPEM, 0o644); err != nil {
		return err
	}
	fmt.Printf("wrote the private key %s (keep it outside the tree) and the public key %s (commit it)\n", private, public)
	return nil
}

// runSigning runs the sign, verify, check-key and keygen commands.
func runSigning(cmd string, fs *flag.FlagSet, args []string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	key := fs.String("key", "", "sign: the private key (SIGNING_KEY); verify: the public key")
	pub := fs.String("pub", "deploy/release/cosign.pub", "the release's public key")
	plainHTTP := fs.Bool("plain-http", false, "the registry speaks plain HTTP (loopback registries do without it)")
	switch cmd {
	case "sign":
		dir := fs.String("dir", "", "the release directory")
		registry := fs.String("registry", "", "where make release-push pushed")
		if err := fs.Parse(args); err != nil {
			return err
		}
		return signRelease(ctx, *dir, *registry, *key, *pub, *plainHTTP)
	case "check-key":
		if err := fs.Parse(args); err != nil {
			return err
		}
		_, err := signingKey(*key, *pub)
		return err
	case "verify":
		image := fs.String("image", "", "the image: REGISTRY/ambient-cni:VERSION or @sha256:...")
		chart := fs.String("chart", "", "the chart: REGISTRY/charts/ambient-cni:VERSION or @sha256:...")
		archive := fs.String("chart-archive", "", "optional: the chart archive the chart must hold")
		if err := fs.Parse(args); err != nil {
			return err
		}
		if *key == "" {
			*key = *pub
		}
		ir, err := parseRef(*image, *plainHTTP)
		if err != nil {
			return err
		}
		cr, err := parseRef(*chart, *plainHTTP)
		if err != nil {
			return err
		}
		var tgz []byte
		if *archive != "" {
			if tgz, err = os.ReadFile(*archive); err != nil {
				return err
			}
		}
		return verifyRelease(ctx, ir, cr, tgz, *key)
	case "keygen":
		private := fs.String("private", "", "where to write the private key (outside the tree)")
		if err := fs.Parse(args); err != nil {
			return err
		}
		return keygen(*private, *pub)
	}
	return fmt.Errorf("unknown command %q", cmd)
}

// the image layout's index, for assemble.
func readIndex(dir string) (v1.ImageIndex, v1.Hash, error) {
	idx, err := ociimage.ReadLayout(dir)
	if err != nil {
		return nil, v1.Hash{}, fmt.Errorf("the image %s: %w", dir, err)
	}
	d, err := idx.Digest()
	return idx, d, err
}
