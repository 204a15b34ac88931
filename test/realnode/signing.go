package realnode

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/sigstore/sigstore/pkg/signature"

	"github.com/ambient-cni/ambient-cni/hack/release/attest"
)

// The node installs what an operator installs from a release, the way
// docs/release.md says to: every artifact pushed to the node's registry
// is signed as make release-push signs it (cosign's layout: a signature
// on the image index and on the chart, the image's SBOM and provenance as
// signed in-toto attestations), and every helm install or upgrade first
// verifies them all with the public key, as make verify-release does,
// then installs the chart and the image by the digests verified. The key
// is made per node: a release's private key is never on a test machine.

// releaseKey is the node's signing key and the verifier of its public half.
type releaseKey struct {
	signer   signature.SignerVerifier
	verifier signature.Verifier
}

// newReleaseKey makes a key pair as make release-key does and loads both
// halves from their PEM, as the signer and a verifier would.
func newReleaseKey() (*releaseKey, error) {
	priv, pub, err := attest.GenerateKey(nil)
	if err != nil {
		return nil, err
	}
	s, err := attest.LoadSigner(priv, nil)
	if err != nil {
		return nil, err
	}
	v, err := attest.LoadVerifier(pub)
	if err != nil {
		return nil, err
	}
	return &releaseKey{signer: s, verifier: v}, nil
}

// signAgent signs the image index pushed as d and attaches its signed
// SBOM and provenance, as make release-push does.
func (n *Node) signAgent(ctx context.Context, d name.Digest, idx v1.ImageIndex, tag string) error {
	if err := attest.Sign(ctx, d, n.Images.key.signer, remote.WithContext(ctx)); err != nil {
		return err
	}
	h, err := v1.NewHash(d.DigestStr())
	if err != nil {
		return err
	}
	cs, plat, goVersion, err := attest.IndexContents(idx)
	if err != nil {
		return fmt.Errorf("the agent image's contents: %w", err)
	}
	repo := d.Context().Name()
	sin := attest.SBOMInput{Name: repo, Version: tag, Index: h, Namespace: imageSource, Created: time.Unix(0, 0).UTC(), Platforms: cs}
	sbom, err := attest.WriteSBOM(attest.SBOM(sin))
	if err != nil {
		return err
	}
	sbomSt, err := attest.SBOMStatement(repo, h, sbom)
	if err != nil {
		return err
	}
	gosum, err := os.ReadFile(filepath.Join(n.Tools.Repo, "go.sum"))
	if err != nil {
		return err
	}
	base, err := attest.FileSHA256(n.Tools.ImageRootfs)
	if err != nil {
		return fmt.Errorf("the image's base: %w", err)
	}
	prov, err := attest.Provenance(attest.ProvenanceInput{
		Name: repo, Index: h, Version: tag, Registry: n.Images.Registry, Source: imageSource,
		Commit: repoCommit(n.Tools.Repo), GoSum: gosum, GoVersion: goVersion,
		Bases: map[string]string{runtime.GOARCH: base}, Platforms: plat,
	})
	if err != nil {
		return err
	}
	return attest.Attest(ctx, d, n.Images.key.signer, [][]byte{sbomSt, prov}, remote.WithContext(ctx))
}

// imageSource is the project's URL, as the release's SBOM and provenance
// name it.
const imageSource = "https://github.com/ambient-cni/ambient-cni"

// repoCommit is the checkout's commit, or "uncommitted" outside a git
// checkout (a release's provenance names one; the node's says so).
func repoCommit(repo string) string {
	out, err := exec.Command("git", "-C", repo, "rev-parse", "HEAD").Output()
	if err != nil {
		return "uncommitted"
	}
	return strings.TrimSpace(string(out))
}

// signChart signs the chart pushed under ChartVersion after checking that
// the registry holds exactly the archive packaged (tgz).
func (n *Node) signChart(ctx context.Context, tgz []byte) error {
	ref, err := n.chartTag()
	if err != nil {
		return err
	}
	d, err := attest.Resolve(ctx, ref, remote.WithContext(ctx))
	if err != nil {
		return err
	}
	if err := attest.CheckChart(ctx, d, tgz, remote.WithContext(ctx)); err != nil {
		return err
	}
	n.Images.chartTgz = tgz
	return attest.Sign(ctx, d, n.Images.key.signer, remote.WithContext(ctx))
}

// chartTag is the chart's tag in the node's registry.
func (n *Node) chartTag() (name.Tag, error) {
	return name.NewTag(n.Images.Registry+"/"+chartRepoPath+"/"+Release+":"+ChartVersion, name.Insecure)
}

// Verified is what a verification of the node's release found, to
// install by: the chart's reference by digest (oci://…@sha256:…), its
// digest alone, and the agent image's index digest.
type Verified struct {
	Chart, ChartDigest, Image string
}

// VerifyRelease checks the agent's image under tag and the chart as make
// verify-release does: the image's signature, its SBOM and provenance
// attestations, the chart's signature and archive, all with the node's
// public key. It fails naming what it refused.
func (n *Node) VerifyRelease(ctx context.Context, tag string) (Verified, error) {
	if n.Images.key == nil {
		return Verified{}, fmt.Errorf("the node's registry holds no signed release")
	}
	v := n.Images.key.verifier
	img, err := name.NewTag(n.AgentRepository()+":"+tag, name.Insecure)
	if err != nil {
		return Verified{}, err
	}
	d, err := attest.VerifySignature(ctx, img, v, remote.WithContext(ctx))
	if err != nil {
		return Verified{}, fmt.Errorf("the agent image %s refused: %w", img, err)
	}
	if _, err := attest.VerifyAttestations(ctx, d, v, []string{attest.SPDXPredicateType, attest.SLSAProvenanceV1}, remote.WithContext(ctx)); err != nil {
		return Verified{}, fmt.Errorf("the agent image's attestations refused: %w", err)
	}
	chart, err := n.chartTag()
	if err != nil {
		return Verified{}, err
	}
	c, err := attest.VerifySignature(ctx, chart, v, remote.WithContext(ctx))
	if err != nil {
		return Verified{}, fmt.Errorf("the chart %s refused: %w", chart, err)
	}
	if err := attest.CheckChart(ctx, c, n.Images.chartTgz, remote.WithContext(ctx)); err != nil {
		return Verified{}, fmt.Errorf("the chart refused: %w", err)
	}
	return Verified{Chart: "oci://" + c.String(), ChartDigest: c.DigestStr(), Image: d.DigestStr()}, nil
}
