// Package attest makes what a release says about itself and checks it:
// the SBOM of the agent's image (SPDX 2.3 JSON: every Go module of every
// Go binary in it and every Debian package of its base), the SLSA v1
// provenance of the release (an in-toto Statement), and signatures with
// a key (ECDSA P-256) in cosign's attachment layout: the image's and the
// chart's simple-signing signature under the tag sha256-HEX.sig, the
// SBOM's and provenance's DSSE envelopes under sha256-HEX.att, so `cosign
// verify` and `cosign verify-attestation` read them as well as Verify
// does. docs/release.md says how a release is signed and checked.
//
// It lives under hack/ on purpose: its libraries (spdx/tools-golang,
// in-toto/attestation, sigstore/sigstore) go into the release tool only,
// never into the agent or the plugin.
package attest

import (
	"archive/tar"
	"bufio"
	"bytes"
	"cmp"
	"crypto/sha256"
	"debug/buildinfo"
	"encoding/hex"
	"fmt"
	"io"
	"net/url"
	"path"
	"regexp"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	spdxjson "github.com/spdx/tools-golang/json"
	"github.com/spdx/tools-golang/spdx/v2/common"
	spdx "github.com/spdx/tools-golang/spdx/v2/v2_3"
)

// GoBinary is one Go executable in an image and its build info.
type GoBinary struct {
	// Path inside the image, without a leading slash.
	Path   string
	SHA256 string
	Info   *buildinfo.BuildInfo
}

// DebPackage is one package of the image's dpkg database.
type DebPackage struct {
	Name, Version, Arch, Source string
}

// Contents is what the SBOM says of one platform's image.
type Contents struct {
	// Arch is the image's architecture (amd64, arm64); Digest its manifest's.
	Arch     string
	Digest   v1.Hash
	Binaries []GoBinary
	Debs     []DebPackage
	// Distro is os-release's ID-VERSION_ID (debian-12), if the image has it.
	Distro string
}

// IndexContents reads every image of an index (ReadContents), each of
// which must hold Go binaries and Debian packages: what a release's SBOM
// lists. Platforms maps each architecture to its image's digest, and
// GoVersion is the toolchain of the first binary, as the provenance names
// them.
func IndexContents(idx v1.ImageIndex) (cs []Contents, platforms map[string]v1.Hash, goVersion string, err error) {
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, nil, "", err
	}
	platforms = map[string]v1.Hash{}
	for _, m := range im.Manifests {
		img, err := idx.Image(m.Digest)
		if err != nil {
			return nil, nil, "", err
		}
		c, err := ReadContents(img)
		if err != nil {
			return nil, nil, "", fmt.Errorf("the %s image: %w", m.Platform.Architecture, err)
		}
		if len(c.Binaries) == 0 || len(c.Debs) == 0 {
			return nil, nil, "", fmt.Errorf("the %s image: %d Go binaries and %d Debian packages found, want some of each (is the base's dpkg status there?)", c.Arch, len(c.Binaries), len(c.Debs))
		}
		goVersion = cmp.Or(goVersion, c.Binaries[0].Info.GoVersion)
		platforms[c.Arch] = c.Digest
		cs = append(cs, c)
	}
	return cs, platforms, goVersion, nil
}

// maxBinary bounds what is read of one executable (the agent is ~60 MB).
const maxBinary = 512 << 20

// ReadContents walks an image's filesystem (its layers applied in order)
// and returns its Go binaries, found by their build info in every
// executable ELF file, and the Debian packages dpkg's status file (or
// distroless' status.d) lists as installed.
func ReadContents(img v1.Image) (Contents, error) {
	var c Contents
	cf, err := img.ConfigFile()
	if err != nil {
		return c, err
	}
	c.Arch = cf.Architecture
	if c.Digest, err = img.Digest(); err != nil {
		return c, err
	}
	rc := mutate.Extract(img)
	defer rc.Close()
	tr := tar.NewReader(rc)
	osRelease := map[string][]byte{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return c, fmt.Errorf("read the image's filesystem: %w", err)
		}
		if h.Typeflag != tar.TypeReg {
			continue
		}
		p := strings.TrimPrefix(path.Clean("/"+h.Name), "/")
		switch {
		case p == "var/lib/dpkg/status" || strings.HasPrefix(p, "var/lib/dpkg/status.d/"):
			b, err := io.ReadAll(tr)
			if err != nil {
				return c, err
			}
			debs, err := ParseDpkgStatus(b, strings.HasPrefix(p, "var/lib/dpkg/status.d/"))
			if err != nil {
				return c, fmt.Errorf("%s: %w", p, err)
			}
			c.Debs = append(c.Debs, debs...)
		case p == "etc/os-release" || p == "usr/lib/os-release":
			if osRelease[p], err = io.ReadAll(tr); err != nil {
				return c, err
			}
		case h.Mode&0o111 != 0 && h.Size > 4 && h.Size < maxBinary:
			b, err := io.ReadAll(tr)
			if err != nil {
				return c, err
			}
			if !bytes.HasPrefix(b, []byte("\x7fELF")) {
				continue
			}
			info, err := buildinfo.Read(bytes.NewReader(b))
			if err != nil {
				continue // not a Go binary
			}
			sum := sha256.Sum256(b)
			c.Binaries = append(c.Binaries, GoBinary{Path: p, SHA256: hex.EncodeToString(sum[:]), Info: info})
		}
	}
	for _, p := range []string{"etc/os-release", "usr/lib/os-release"} {
		if b, ok := osRelease[p]; ok {
			c.Distro = distro(b)
			break
		}
	}
	slices.SortFunc(c.Binaries, func(a, b GoBinary) int { return strings.Compare(a.Path, b.Path) })
	slices.SortFunc(c.Debs, func(a, b DebPackage) int { return strings.Compare(a.Name+":"+a.Arch, b.Name+":"+b.Arch) })
	return c, nil
}

func distro(osRelease []byte) string {
	kv := map[string]string{}
	for l := range strings.SplitSeq(string(osRelease), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok {
			kv[k] = strings.Trim(v, `"`)
		}
	}
	if kv["ID"] == "" || kv["VERSION_ID"] == "" {
		return ""
	}
	return kv["ID"] + "-" + kv["VERSION_ID"]
}

// ParseDpkgStatus returns the packages of a dpkg status file whose Status
// says installed (any, for a status.d file, which has no Status field).
func ParseDpkgStatus(b []byte, statusD bool) ([]DebPackage, error) {
	var out []DebPackage
	fields := map[string]string{}
	flush := func() error {
		defer clear(fields)
		if len(fields) == 0 {
			return nil
		}
		if fields["Package"] == "" || fields["Version"] == "" {
			return fmt.Errorf("a paragraph without Package or Version: %v", fields)
		}
		if !statusD && !strings.HasSuffix(fields["Status"], " installed") {
			return nil
		}
		src, _, _ := strings.Cut(fields["Source"], " ")
		out = append(out, DebPackage{Name: fields["Package"], Version: fields["Version"], Arch: fields["Architecture"], Source: src})
		return nil
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
	for sc.Scan() {
		l := sc.Text()
		if strings.TrimSpace(l) == "" {
			if err := flush(); err != nil {
				return nil, err
			}
			continue
		}
		if l[0] == ' ' || l[0] == '\t' {
			continue // a continuation line
		}
		if k, v, ok := strings.Cut(l, ":"); ok {
			fields[k] = strings.TrimSpace(v)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if err := flush(); err != nil {
		return nil, err
	}
	return out, nil
}

// SBOMInput names what the SBOM describes.
type SBOMInput struct {
	// Name is the image's repository (REGISTRY/ambient-cni), Version the
	// release's; Index the image index's digest.
	Name, Version string
	Index         v1.Hash
	// Namespace is the URL the document's namespace is made under (the
	// project's homepage).
	Namespace string
	// Created is the document's creation time (the release's
	// SOURCE_DATE_EPOCH, so the same release gives the same bytes).
	Created   time.Time
	Platforms []Contents
}

// Go module and Debian package identifiers (package URLs).
func goPURL(mod, version string) string {
	return "pkg:golang/" + mod + "@" + url.PathEscape(version)
}

func debPURL(d DebPackage, distro string) string {
	q := url.Values{}
	if d.Arch != "" {
		q.Set("arch", d.Arch)
	}
	if distro != "" {
		q.Set("distro", distro)
	}
	s := "pkg:deb/debian/" + d.Name + "@" + url.PathEscape(d.Version)
	if len(q) > 0 {
		s += "?" + q.Encode()
	}
	return s
}

var notID = regexp.MustCompile(`[^A-Za-z0-9.-]+`)

func elementID(parts ...string) common.ElementID {
	return common.ElementID(notID.ReplaceAllString(strings.Join(parts, "-"), "-"))
}

// SBOM returns the SPDX 2.3 document of an image index: the index, each
// platform's image in it, each image's Go binaries with every module each
// was built from (the main module, its dependencies as go version -m
// lists them, replacements resolved, and the Go standard library), and
// each image's Debian packages.
func SBOM(in SBOMInput) *spdx.Document {
	root := elementID("Image")
	doc := &spdx.Document{
		SPDXVersion:       spdx.Version,
		DataLicense:       spdx.DataLicense,
		SPDXIdentifier:    "DOCUMENT",
		DocumentName:      path.Base(in.Name) + "-" + in.Version,
		DocumentNamespace: strings.TrimSuffix(in.Namespace, "/") + "/spdx/" + in.Version + "/" + in.Index.Hex,
		CreationInfo: &spdx.CreationInfo{
			Creators: []common.Creator{{CreatorType: "Tool", Creator: "ambient-cni-release-" + in.Version}},
			Created:  in.Created.UTC().Format(time.RFC3339),
		},
	}
	pkg := func(id common.ElementID, name, version, purl, sha string) *spdx.Package {
		p := &spdx.Package{
			PackageName: name, PackageSPDXIdentifier: id, PackageVersion: version,
			PackageDownloadLocation: "NOASSERTION",
		}
		if purl != "" {
			p.PackageExternalReferences = []*spdx.PackageExternalReference{{Category: "PACKAGE-MANAGER", RefType: "purl", Locator: purl}}
		}
		if sha != "" {
			p.PackageChecksums = []common.Checksum{{Algorithm: common.SHA256, Value: sha}}
		}
		doc.Packages = append(doc.Packages, p)
		return p
	}
	rel := func(a, b common.ElementID, kind string) {
		doc.Relationships = append(doc.Relationships, &spdx.Relationship{
			RefA: common.MakeDocElementID("", string(a)), RefB: common.MakeDocElementID("", string(b)), Relationship: kind,
		})
	}
	repo := path.Base(in.Name)
	ociPURL := func(d v1.Hash, arch string) string {
		q := url.Values{"repository_url": {in.Name}}
		if arch != "" {
			q.Set("arch", arch)
		}
		return "pkg:oci/" + repo + "@" + url.PathEscape(d.String()) + "?" + q.Encode()
	}
	top := pkg(root, repo, in.Version, ociPURL(in.Index, ""), in.Index.Hex)
	top.PrimaryPackagePurpose = "CONTAINER"
	rel("DOCUMENT", root, "DESCRIBES")
	for _, c := range in.Platforms {
		img := elementID("Image", c.Arch)
		p := pkg(img, repo+" linux/"+c.Arch, in.Version, ociPURL(c.Digest, c.Arch), c.Digest.Hex)
		p.PrimaryPackagePurpose = "CONTAINER"
		rel(root, img, "CONTAINS")
		for _, b := range c.Binaries {
			bin := elementID(c.Arch, "bin", b.Path)
			bp := pkg(bin, path.Base(b.Path), in.Version, "", b.SHA256)
			bp.PackageFileName = "/" + b.Path
			bp.PrimaryPackagePurpose = "APPLICATION"
			bp.PackageComment = "Go binary built with " + b.Info.GoVersion
			rel(img, bin, "CONTAINS")
			for i, m := range Modules(b.Info) {
				id := elementID(c.Arch, "bin", b.Path, "go", fmt.Sprint(i))
				mp := pkg(id, m.Path, m.Version, goPURL(m.Path, m.Version), "")
				mp.PrimaryPackagePurpose = "LIBRARY"
				if m.Sum != "" {
					mp.PackageComment = "go.sum " + m.Sum
				}
				rel(bin, id, "CONTAINS")
			}
		}
		for _, d := range c.Debs {
			id := elementID(c.Arch, "deb", d.Name, d.Arch)
			dp := pkg(id, d.Name, d.Version, debPURL(d, c.Distro), "")
			dp.PrimaryPackagePurpose = "OPERATING-SYSTEM"
			if d.Source != "" {
				dp.PackageSourceInfo = "built from the Debian source package " + d.Source
			}
			rel(img, id, "CONTAINS")
		}
	}
	return doc
}

// Module is one Go module a binary was built from.
type Module struct{ Path, Version, Sum string }

// Modules lists a Go binary's modules as the SBOM does: the main module,
// each dependency (its replacement when replaced), and the standard
// library as the module "stdlib" at the Go version.
func Modules(info *buildinfo.BuildInfo) []Module {
	ms := []Module{{Path: info.Main.Path, Version: info.Main.Version, Sum: info.Main.Sum}}
	for _, d := range info.Deps {
		if d.Replace != nil {
			d = d.Replace
		}
		ms = append(ms, Module{Path: d.Path, Version: d.Version, Sum: d.Sum})
	}
	return append(ms, Module{Path: "stdlib", Version: info.GoVersion})
}

// WriteSBOM encodes an SPDX document as indented JSON.
func WriteSBOM(doc *spdx.Document) ([]byte, error) {
	var b bytes.Buffer
	if err := spdxjson.Write(doc, &b, spdxjson.Indent("  ")); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// ReadSBOM decodes an SPDX JSON document.
func ReadSBOM(b []byte) (*spdx.Document, error) {
	return spdxjson.Read(bytes.NewReader(b))
}
