package ociimage

import (
	"archive/tar"
	"bytes"
	"debug/elf"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
)

// rootfsTool is the cached Debian base of make image for arch, built by
// hack/kube-tools.sh image-rootfs-ARCH (skips, or fails under CI=true,
// when it is not built).
func rootfsTool(t *testing.T, arch string) string {
	t.Helper()
	if os.Getenv("AMBIENT_UNIT_ONLY") != "" {
		t.Skip("skipping: needs the image rootfs, and AMBIENT_UNIT_ONLY is set")
	}
	out, err := exec.Command("bash", "../../kube-tools.sh", "--path", "image-rootfs-"+arch).Output()
	if err != nil {
		t.Fatalf("kube-tools.sh --path image-rootfs-%s: %v", arch, err)
	}
	p := strings.TrimSpace(string(out))
	if _, err := os.Stat(p); err != nil {
		testnet.Missing(t, "image-rootfs-"+arch+" is not built: hack/kube-tools.sh image-rootfs-"+arch+" (make image builds it)")
	}
	return p
}

// imageEntry is what an image holds at a path after all its layers.
type imageEntry struct {
	mode os.FileMode
	data []byte // regular files of the agent's layer and ELF checks only
	link string
}

// flatten applies an image's layers in order (no whiteouts: the builder
// writes none) and returns every path's entry.
func flatten(t *testing.T, img v1.Image) map[string]imageEntry {
	t.Helper()
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]imageEntry{}
	for _, l := range ls {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			e := imageEntry{mode: h.FileInfo().Mode(), link: h.Linkname}
			if h.Typeflag == tar.TypeReg && h.Size < 256<<20 {
				if e.data, err = io.ReadAll(tr); err != nil {
					t.Fatal(err)
				}
			}
			out["/"+strings.TrimSuffix(h.Name, "/")] = e
		}
		rc.Close()
	}
	return out
}

// archNeutral names a path the same for both architectures: the
// multiarch triplet and the dynamic loader's name are the architecture's.
var archNeutral = strings.NewReplacer(
	"x86_64-linux-gnu", "TRIPLET", "aarch64-linux-gnu", "TRIPLET",
	"ld-linux-x86-64.so.2", "LOADER", "ld-linux-aarch64.so.1", "LOADER",
)

// archOnly are paths only one architecture's Debian has, whatever the
// packages: amd64's lib32/lib64/libx32 compatibility directories (merged
// /usr links and the loader's /lib64 home), util-linux's setarch links
// for x86, glibc's x86-only vector math library, and arm64's loader in
// /usr/lib (amd64's is in /usr/lib64).
func archOnly(p string) bool {
	switch p {
	case "/usr/bin/i386", "/usr/bin/x86_64", "/usr/lib/TRIPLET/libmvec.so.1", "/usr/lib/LOADER":
		return true
	}
	for _, d := range []string{"/lib32", "/lib64", "/libx32", "/usr/lib32", "/usr/lib64", "/usr/libx32"} {
		if p == d || strings.HasPrefix(p, d+"/") {
			return true
		}
	}
	return false
}

// TestAgentImage builds make image's image from the cached Debian bases
// and the binaries cross-built for both architectures, twice (one
// digest), and checks the two architectures carry the same files (paths
// and modes, the architecture's triplet aside), each with binaries of its
// own machine, and the iptables tools the agent runs.
func TestAgentImage(t *testing.T) {
	if testing.Short() {
		t.Skip("cross-builds the binaries")
	}
	s := Spec{Version: "v0.0.0-imagetest", Revision: "0123456789abcdef", Source: "https://example.invalid/ambient-cni"}
	machine := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}
	root, err := filepath.Abs("../../..")
	if err != nil {
		t.Fatal(err)
	}
	for _, arch := range []string{"amd64", "arm64"} {
		rootfs := rootfsTool(t, arch)
		bin := filepath.Join(t.TempDir(), arch)
		for _, b := range [][]string{{"-o", bin + "/ambient-cni", "./cmd/cni-plugin"}, {"-o", bin + "/", "./cmd/install-cni", "./cmd/ambient-cni-uninstall", "./cmd/ambient-cni-fallback"}} {
			cmd := exec.Command("go", append([]string{"build", "-trimpath", "-ldflags=-s -w"}, b...)...)
			cmd.Dir = root
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+arch)
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("build %s binaries: %v\n%s", arch, err, out)
			}
		}
		s.Platforms = append(s.Platforms, Platform{Arch: arch, Rootfs: rootfs, BinDir: bin})
	}
	idx, err := Build(s)
	if err != nil {
		t.Fatal(err)
	}
	if a, b := digest(t, s), digest(t, s); a != b {
		t.Fatalf("two builds of the same inputs: %s and %s", a, b)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(m.Manifests) != 2 {
		t.Fatalf("%d images in the index, want 2", len(m.Manifests))
	}
	files := map[string]map[string]os.FileMode{}
	for _, desc := range m.Manifests {
		arch := desc.Platform.Architecture
		img, err := idx.Image(desc.Digest)
		if err != nil {
			t.Fatal(err)
		}
		all := flatten(t, img)
		neutral := map[string]os.FileMode{}
		for p, e := range all {
			if n := archNeutral.Replace(p); !archOnly(n) {
				neutral[n] = e.mode
			}
		}
		files[arch] = neutral
		// The agent's binaries and the rule tools are this architecture's.
		for _, p := range append(slices.Sorted(maps.Keys(AgentFiles)), "/usr/sbin/xtables-nft-multi", "/usr/sbin/xtables-legacy-multi", "/usr/sbin/nft", "/usr/sbin/ipset") {
			e, ok := all[p]
			if !ok || e.data == nil {
				t.Errorf("%s: no %s", arch, p)
				continue
			}
			f, err := elf.NewFile(bytes.NewReader(e.data))
			if err != nil {
				t.Errorf("%s: %s: %v", arch, p, err)
				continue
			}
			if f.Machine != machine[arch] {
				t.Errorf("%s: %s is for %v, want %v", arch, p, f.Machine, machine[arch])
			}
		}
		// The alternatives the iptables package's scripts would have set.
		for _, p := range []string{"iptables", "iptables-restore", "iptables-save", "ip6tables", "ip6tables-restore", "ip6tables-save"} {
			if e := all["/usr/sbin/"+p]; e.link != "/etc/alternatives/"+p || all["/etc/alternatives/"+p].link != "/usr/sbin/"+strings.Replace(p, "tables", "tables-nft", 1) {
				t.Errorf("%s: /usr/sbin/%s -> %q -> %q, want the nft flavour through /etc/alternatives", arch, p, e.link, all["/etc/alternatives/"+p].link)
			}
		}
		for _, p := range []string{"/etc/passwd", "/etc/group", "/usr/bin/sh", "/bin"} {
			if _, ok := all[p]; !ok {
				t.Errorf("%s: no %s", arch, p)
			}
		}
	}
	amd, arm := files["amd64"], files["arm64"]
	var diff []string
	for _, p := range slices.Sorted(maps.Keys(amd)) {
		if mode, ok := arm[p]; !ok {
			diff = append(diff, "amd64 only: "+p)
		} else if mode != amd[p] {
			diff = append(diff, "mode differs: "+p+" amd64 "+amd[p].String()+" arm64 "+mode.String())
		}
	}
	for _, p := range slices.Sorted(maps.Keys(arm)) {
		if _, ok := amd[p]; !ok {
			diff = append(diff, "arm64 only: "+p)
		}
	}
	if len(diff) > 0 {
		t.Errorf("the architectures' images differ in %d paths (of %d):\n%s", len(diff), len(amd), strings.Join(diff, "\n"))
	}
	t.Logf("both architectures carry the same %d paths", len(amd))
}
