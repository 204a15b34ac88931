package deploy

import (
	"regexp"
	"strings"
	"testing"
)

// imageLine is every image a rendering names (the DaemonSet's container
// and the uninstall hook's).
var imageLine = regexp.MustCompile(`(?m)^\s+image: "?([^"\s]+)"?\s*$`)

// image.digest pulls by digest, with or without a tag beside it; without
// one the image is repository:tag (tag empty: the chart's appVersion),
// and a malformed digest fails at render time.
func TestImageDigest(t *testing.T) {
	const d = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	for _, c := range []struct {
		name string
		set  []string
		want string
	}{
		{"digest", []string{"image.repository=r.example/a", "image.digest=" + d}, "r.example/a@" + d},
		{"tag and digest", []string{"image.repository=r.example/a", "image.tag=v1", "image.digest=" + d}, "r.example/a:v1@" + d},
		{"tag", []string{"image.repository=r.example/a", "image.tag=v1"}, "r.example/a:v1"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var args []string
			for _, s := range c.set {
				args = append(args, "--set", s)
			}
			out := string(render(t, "digest", "digest-ns", args...))
			got := imageLine.FindAllStringSubmatch(out, -1)
			if len(got) < 2 {
				t.Fatalf("found %d images, want the DaemonSet's and the hook's:\n%s", len(got), out)
			}
			for _, m := range got {
				if m[1] != c.want {
					t.Errorf("image %s, want %s", m[1], c.want)
				}
			}
		})
	}
	_, err := helm(t, "template", "digest", chartDir, "--set", "image.digest=latest")
	if err == nil || !strings.Contains(err.Error(), "digest") {
		t.Errorf("image.digest=latest rendered (err %v), want a schema error naming digest", err)
	}
}
