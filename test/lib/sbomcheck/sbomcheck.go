// Package sbomcheck holds what tests compare a release's SPDX SBOM with,
// read by other tools than the SBOM's maker: a Go binary's modules as go
// version -m lists them, and the packages dpkg-query finds installed in a
// root filesystem's dpkg database.
package sbomcheck

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	spdx "github.com/spdx/tools-golang/spdx/v2/v2_3"
)

// GoVersionM is what go version -m says of a binary: its modules as
// path@version (a replaced module as its replacement) and the standard
// library as stdlib@GOVERSION, and the Go version.
func GoVersionM(t testing.TB, bin string) (mods []string, goVersion string) {
	t.Helper()
	out, err := exec.Command("go", "version", "-m", bin).Output()
	if err != nil {
		t.Fatalf("go version -m %s: %v", bin, err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	_, goVersion, _ = strings.Cut(lines[0], ": ")
	for _, l := range lines[1:] {
		f := strings.Fields(l)
		if len(f) < 3 {
			continue
		}
		switch f[0] {
		case "mod", "dep":
			mods = append(mods, f[1]+"@"+f[2])
		case "=>": // replaces the module on the line above
			mods[len(mods)-1] = f[1] + "@" + f[2]
		}
	}
	return append(mods, "stdlib@"+goVersion), goVersion
}

// DpkgInstalled lists the packages dpkg-query finds installed in a root
// filesystem tarball's dpkg database, as name@version:arch, sorted.
func DpkgInstalled(t testing.TB, rootfs string) []string {
	t.Helper()
	dir := t.TempDir()
	if out, err := exec.Command("tar", "-C", dir, "-xf", rootfs, "./var/lib/dpkg/status").CombinedOutput(); err != nil {
		t.Fatalf("tar: %v: %s", err, out)
	}
	admin := filepath.Join(dir, "var", "lib", "dpkg")
	for _, d := range []string{"updates", "info"} {
		if err := os.MkdirAll(filepath.Join(admin, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	out, err := exec.Command("dpkg-query", "--admindir="+admin, "-W", "-f", "${db:Status-Abbrev}|${Package}@${Version}:${Architecture}\n").Output()
	if err != nil {
		t.Fatalf("dpkg-query: %v", err)
	}
	var pkgs []string
	for l := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
		if st, p, _ := strings.Cut(l, "|"); strings.HasPrefix(st, "ii") {
			pkgs = append(pkgs, p)
		}
	}
	slices.Sort(pkgs)
	return pkgs
}

// Contained returns the packages an SPDX element CONTAINS.
func Contained(doc *spdx.Document, id string) []*spdx.Package {
	byID := map[string]*spdx.Package{}
	for _, p := range doc.Packages {
		byID[string(p.PackageSPDXIdentifier)] = p
	}
	var out []*spdx.Package
	for _, r := range doc.Relationships {
		if string(r.RefA.ElementRefID) == id && r.Relationship == "CONTAINS" {
			out = append(out, byID[string(r.RefB.ElementRefID)])
		}
	}
	return out
}

// Image is what an SBOM says one platform's image holds: each Go
// binary's modules (path@version, sorted) by its path in the image, and
// the Debian packages (name@version:arch, sorted).
type Image struct {
	Binaries map[string][]string
	Debs     []string
}

// ImageOf reads the SBOM's image of an architecture (element
// SPDXRef-Image-ARCH).
func ImageOf(doc *spdx.Document, arch string) Image {
	im := Image{Binaries: map[string][]string{}}
	for _, p := range Contained(doc, "Image-"+arch) {
		if p.PackageFileName != "" {
			var mods []string
			for _, m := range Contained(doc, string(p.PackageSPDXIdentifier)) {
				mods = append(mods, m.PackageName+"@"+m.PackageVersion)
			}
			slices.Sort(mods)
			im.Binaries[p.PackageFileName] = mods
			continue
		}
		a := ""
		for _, r := range p.PackageExternalReferences {
			if _, q, ok := strings.Cut(r.Locator, "arch="); ok {
				a, _, _ = strings.Cut(q, "&")
			}
		}
		im.Debs = append(im.Debs, p.PackageName+"@"+p.PackageVersion+":"+a)
	}
	slices.Sort(im.Debs)
	return im
}

// Minus returns the elements of a not in b.
func Minus(a, b []string) []string {
	var out []string
	for _, s := range a {
		if !slices.Contains(b, s) {
			out = append(out, s)
		}
	}
	return out
}
