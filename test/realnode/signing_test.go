//go:build realnode

package realnode

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/hack/imagebuild/ociimage"
)

// testTamperedRefused changes the release in the node's registry as an
// attacker with push rights would, and shows every install refused
// before helm runs, the release left as it was: another image under a
// signed tag, then another chart under the signed chart's version. The
// chart's tag is then put back on the signed chart, which verifies again.
func (e *e2e) testTamperedRefused(t *testing.T) {
	ctx := context.Background()
	n := e.n
	before, err := n.VerifyRelease(ctx, ImageTag)
	if err != nil {
		t.Fatalf("the release as pushed does not verify: %v", err)
	}
	t.Logf("verified: chart %s, image %s", before.Chart, before.Image)
	generation := func() int64 {
		ds, err := n.Client.AppsV1().DaemonSets(ReleaseNamespace).Get(ctx, Release, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return ds.Generation
	}
	gen := generation()
	refused := func(what, tag, want string) {
		t.Helper()
		err := n.InstallAgent(ctx, "upgrade", tag)
		if err == nil {
			t.Fatalf("%s: the upgrade ran", what)
		}
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%s: refused with %q, want it to name %q", what, err, want)
		}
		t.Logf("%s: %v", what, err)
		if g := generation(); g != gen {
			t.Errorf("%s: the DaemonSet changed (generation %d, was %d)", what, g, gen)
		}
	}

	// Another image under a signed tag: its digest has no signature.
	const tag = "tamper"
	if _, err := n.PushAgentTag(ctx, tag); err != nil {
		t.Fatal(err)
	}
	idx, err := ociimage.ReadLayout(n.Images.agentLayout)
	if err != nil {
		t.Fatal(err)
	}
	if idx, err = relabel(idx, tag+"-other"); err != nil {
		t.Fatal(err)
	}
	ref, err := name.NewTag(n.AgentRepository()+":"+tag, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.WriteIndex(ref, idx, remote.WithContext(ctx)); err != nil {
		t.Fatal(err)
	}
	refused("another image under a signed tag", tag, "has no signature")

	// Another chart under the signed chart's version.
	dir := t.TempDir()
	if _, err := n.Helm(ctx, "package", ChartDir, "--version", ChartVersion, "--app-version", tag, "-d", dir); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Helm(ctx, "push", filepath.Join(dir, Release+"-"+ChartVersion+".tgz"), "oci://"+n.Images.Registry+"/"+chartRepoPath, "--plain-http"); err != nil {
		t.Fatal(err)
	}
	refused("another chart under the signed version", ImageTag, "has no signature")

	// The signed chart tagged again: it verifies, as it was.
	chartTag, err := n.chartTag()
	if err != nil {
		t.Fatal(err)
	}
	signed := chartTag.Context().Digest(before.ChartDigest)
	desc, err := remote.Get(signed, remote.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Tag(chartTag, desc, remote.WithContext(ctx)); err != nil {
		t.Fatal(err)
	}
	after, err := n.VerifyRelease(ctx, ImageTag)
	if err != nil || after != before {
		t.Fatalf("the signed chart tagged again: %+v, %v; want %+v", after, err, before)
	}
}
