package main

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"sigs.k8s.io/yaml"
)

// semVer is what a release version must be: SemVer 2.0 without a
// leading v (the git tag adds it: vX.Y.Z), so the chart, the image tag
// and the binaries all carry the same string.
var semVer = regexp.MustCompile(`^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$`)

// CheckVersion refuses a version a release cannot carry.
func CheckVersion(v string) error {
	if !semVer.MatchString(v) {
		return fmt.Errorf("version %q is not SemVer X.Y.Z[-pre] (no leading v: the tag is vX.Y.Z)", v)
	}
	return nil
}

// Notes returns the body of CHANGELOG's section of version v: the lines
// after its heading "## [v]" (a date may follow: "## [v] - 2026-12-06")
// up to the next "## " heading, trimmed.
func Notes(changelog []byte, v string) (string, error) {
	var body []string
	in, found := false, false
	sc := bufio.NewScanner(bytes.NewReader(changelog))
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, "## ") {
			if in {
				break
			}
			h := strings.TrimSpace(strings.TrimPrefix(l, "## "))
			if h == "["+v+"]" || strings.HasPrefix(h, "["+v+"] ") {
				in, found = true, true
			}
			continue
		}
		if in {
			body = append(body, l)
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	if !found {
		return "", fmt.Errorf("CHANGELOG.md has no section \"## [%s]\": a release cuts its notes from it; rename \"## Unreleased\" to \"## [%s] - YYYY-MM-DD\" (and start a new Unreleased above it), commit, then make release", v, v)
	}
	s := strings.TrimSpace(strings.Join(body, "\n"))
	if s == "" {
		return "", fmt.Errorf("CHANGELOG.md's section \"## [%s]\" is empty", v)
	}
	return s, nil
}

// StampValues sets the chart's default image in values.yaml: the
// top-level image block's repository and digest lines get repo and
// digest, everything else (comments, order) stays as it is.
func StampValues(values []byte, repo, digest string) ([]byte, error) {
	lines := strings.Split(string(values), "\n")
	in := false
	set := map[string]int{}
	for i, l := range lines {
		if l == "image:" {
			in = true
			continue
		}
		if in && l != "" && !strings.HasPrefix(l, " ") && !strings.HasPrefix(l, "#") {
			break // the next top-level key
		}
		if !in {
			continue
		}
		for key, val := range map[string]string{"repository": repo, "digest": digest} {
			if strings.HasPrefix(l, "  "+key+":") {
				lines[i] = "  " + key + ": " + val
				set[key]++
			}
		}
	}
	if set["repository"] != 1 || set["digest"] != 1 {
		return nil, fmt.Errorf("values.yaml: want one image.repository and one image.digest line, found %d and %d", set["repository"], set["digest"])
	}
	return []byte(strings.Join(lines, "\n")), nil
}

// NormalizeChart rewrites helm package's archive (helm stamps every entry
// with the time of packaging) with every entry at mtime, owned by 0:0
// without names, and the gzip header helm wrote (its comment and extra
// field) kept: the same chart gives the same bytes.
func NormalizeChart(in []byte, mtime time.Time) ([]byte, error) {
	zr, err := gzip.NewReader(bytes.NewReader(in))
	if err != nil {
		return nil, err
	}
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	zw.Comment, zw.Extra, zw.Name = zr.Comment, zr.Extra, zr.Name
	tr, tw := tar.NewReader(zr), tar.NewWriter(zw)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
		h.ModTime, h.AccessTime, h.ChangeTime = mtime, time.Time{}, time.Time{}
		h.Uid, h.Gid, h.Uname, h.Gname = 0, 0, "", ""
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := io.Copy(tw, tr); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

// Archive returns a tar.gz of one executable named name: one entry, mode
// 0755, owned by 0:0 without names, at mtime, and a gzip header without
// a name or a time, so the same binary gives the same bytes.
func Archive(name string, data []byte, mtime time.Time) ([]byte, error) {
	var out bytes.Buffer
	zw := gzip.NewWriter(&out)
	tw := tar.NewWriter(zw)
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o755, Size: int64(len(data)), ModTime: mtime, Format: tar.FormatPAX}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(data); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	return out.Bytes(), nil
}

// KrewPlugin is krew's plugin manifest (apiVersion
// krew.googlecontainertools.github.com/v1alpha2, kind Plugin), the fields
// this release fills.
type KrewPlugin struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Spec KrewSpec `json:"spec"`
}

// KrewSpec is a krew plugin's spec.
type KrewSpec struct {
	Version          string         `json:"version"`
	Homepage         string         `json:"homepage,omitempty"`
	ShortDescription string         `json:"shortDescription"`
	Description      string         `json:"description,omitempty"`
	Platforms        []KrewPlatform `json:"platforms"`
}

// KrewPlatform is one platform's archive.
type KrewPlatform struct {
	Selector struct {
		MatchLabels map[string]string `json:"matchLabels"`
	} `json:"selector"`
	URI    string `json:"uri"`
	Sha256 string `json:"sha256"`
	Bin    string `json:"bin"`
}

// Krew names: the plugin (kubectl ambient-cni; krew links its binary as
// kubectl-ambient_cni) and the binary inside each archive.
const (
	KrewPluginName = "ambient-cni"
	PluginBinary   = "kubectl-ambient_cni"
)

// PluginArchiveName is the archive of the kubectl plugin for one platform.
func PluginArchiveName(version, goos, goarch string) string {
	return fmt.Sprintf("%s_%s_%s_%s.tar.gz", PluginBinary, version, goos, goarch)
}

// KrewManifest is the krew manifest of the plugin's archives: archives
// maps "os/arch" to the archive's bytes, baseURL is where the archives
// are downloaded from (krew fetches uri unless given --archive).
func KrewManifest(version, baseURL, homepage string, archives map[string][]byte) ([]byte, error) {
	var p KrewPlugin
	p.APIVersion, p.Kind = "krew.googlecontainertools.github.com/v1alpha2", "Plugin"
	p.Metadata.Name = KrewPluginName
	p.Spec = KrewSpec{
		// krew wants a v in front.
		Version:          "v" + version,
		Homepage:         homepage,
		ShortDescription: "Why a pod is or is not in Istio's ambient mesh (ambient-cni)",
		Description: "Asks ambient-cni's node agent on a pod's node why the pod is or is not\n" +
			"captured into Istio's ambient mesh (explain NS/POD), or how a node's\n" +
			"agent is doing (status NODE). Needs ambient-cni installed in the cluster.\n",
	}
	for _, plat := range slices.Sorted(maps.Keys(archives)) {
		goos, goarch, ok := strings.Cut(plat, "/")
		if !ok {
			return nil, fmt.Errorf("platform %q: want os/arch", plat)
		}
		sum := sha256.Sum256(archives[plat])
		var kp KrewPlatform
		kp.Selector.MatchLabels = map[string]string{"os": goos, "arch": goarch}
		kp.URI = strings.TrimSuffix(baseURL, "/") + "/" + PluginArchiveName(version, goos, goarch)
		kp.Sha256 = hex.EncodeToString(sum[:])
		kp.Bin = PluginBinary
		p.Spec.Platforms = append(p.Spec.Platforms, kp)
	}
	return yaml.Marshal(p)
}

// SumsName is the checksum file of a release directory.
const SumsName = "SHA256SUMS"

// Sums returns the SHA256SUMS of every regular file under dir but
// SHA256SUMS itself, in sha256sum's format (sha256sum -c reads it in
// dir), sorted by path.
func Sums(dir string) ([]byte, error) {
	var lines []string
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.Type().IsRegular() {
			if d.IsDir() {
				return nil
			}
			return fmt.Errorf("%s: not a regular file", p)
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil {
			return err
		}
		if rel == SumsName {
			return nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		sum := sha256.Sum256(b)
		lines = append(lines, hex.EncodeToString(sum[:])+"  "+filepath.ToSlash(rel)+"\n")
		return nil
	})
	if err != nil {
		return nil, err
	}
	if len(lines) == 0 {
		return nil, errors.New("no files")
	}
	slices.SortFunc(lines, func(a, b string) int { return strings.Compare(a[66:], b[66:]) })
	return []byte(strings.Join(lines, "")), nil
}
