package netns

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/fuzzseed"
	"k8s.io/apimachinery/pkg/types"
)

const (
	uid  = "0b7c6f0e-1111-4222-8333-444455556666"
	uidU = "0b7c6f0e_1111_4222_8333_444455556666" // systemd-escaped
	uid2 = "9f0e1d2c-aaaa-4bbb-8ccc-ddddeeeeffff"
	cid  = "9bca8d63d5fa610783847915bcff0ecac1273e5b4bed3f6fa1b07350e0135961"
	cid2 = "a55d9ac3b312d8a2627824b6d6dd8af66fbec439bf4e0ec22d6d9945ad337a38"
)

func TestParseCgroup(t *testing.T) {
	cases := []struct {
		name, in string
		want     PodCgroup // zero: rejected
	}{
		// Host view (the agent shares the host's cgroup namespace).
		{"v1 cgroupfs burstable", "12:memory:/kubepods/burstable/pod" + uid + "/" + cid + "\n", PodCgroup{uid, cid}},
		{"v1 cgroupfs guaranteed", "4:pids:/kubepods/pod" + uid + "/" + cid + "\n", PodCgroup{uid, cid}},
		{"v1 cgroupfs under a cgroup root", "4:pids:/kubelet/kubepods/besteffort/pod" + uid + "/" + cid + "\n", PodCgroup{uid, cid}},
		{"node in a docker container (kind)", "0::/docker/" + cid2 + "/kubepods/besteffort/pod" + uid + "/" + cid + "\n", PodCgroup{uid, cid}},
		{"v2 cgroupfs", "0::/kubepods/besteffort/pod" + uid + "/" + cid + "\n", PodCgroup{uid, cid}},
		{"v2 cgroupfs cri-o", "0::/kubepods/besteffort/pod" + uid + "/crio-" + cid + "\n", PodCgroup{uid, cid}},
		{"v2 systemd containerd", "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope\n", PodCgroup{uid, cid}},
		{"v2 systemd cri-o", "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + uidU + ".slice/crio-" + cid + ".scope\n", PodCgroup{uid, cid}},
		{"v2 systemd docker", "0::/kubepods.slice/kubepods-pod" + uidU + ".slice/docker-" + cid + ".scope\n", PodCgroup{uid, cid}},
		{"v1 systemd guaranteed", "1:name=systemd:/kubepods.slice/kubepods-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope\n", PodCgroup{uid, cid}},
		{"systemd under a root slice", "0::/system.slice/node.slice/node-kubepods.slice/node-kubepods-burstable.slice/node-kubepods-burstable-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope\n", PodCgroup{uid, cid}},
		{"systemd path applied by cgroupfs", "0::/kubepods-besteffort-pod" + uidU + ".slice:cri-containerd:" + cid + "\n", PodCgroup{uid, cid}},
		{"hybrid: root in unused hierarchies", "9:name=systemd:/\n8:pids:/kubepods/pod" + uid + "/" + cid + "\n4:memory:/user.slice\n0::/\n", PodCgroup{uid, cid}},
		{"sub-cgroup of the container", "0::/kubepods/burstable/pod" + uid + "/" + cid + "/init.scope\n", PodCgroup{uid, cid}},
		{"no trailing newline", "0::/kubepods/pod" + uid + "/" + cid, PodCgroup{uid, cid}},
		{"colon in a sub-cgroup", "0::/kubepods/pod" + uid + "/" + cid + "/a:b\n", PodCgroup{uid, cid}},

		// The agent in its own cgroup namespace (cgroupns=private): paths
		// are relative to its own container cgroup, no kubepods left.
		{"cgroupns v2 same QoS", "0::/../../pod" + uid + "/" + cid + "\n", PodCgroup{uid, cid}},
		{"cgroupns v2 other QoS", "0::/../../../besteffort/pod" + uid + "/" + cid + "\n", PodCgroup{uid, cid}},
		{"cgroupns v2 guaranteed", "0::/../../../pod" + uid + "/" + cid + "\n", PodCgroup{uid, cid}},
		{"cgroupns v1 hybrid", "9:name=systemd:/\n8:pids:/../../pod" + uid + "/" + cid + "\n4:memory:/\n0::/../../pod" + uid + "/" + cid + "\n", PodCgroup{uid, cid}},
		{"cgroupns systemd same QoS", "0::/../../kubepods-burstable-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope\n", PodCgroup{uid, cid}},
		{"cgroupns systemd other QoS", "0::/../../../kubepods-besteffort.slice/kubepods-besteffort-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope\n", PodCgroup{uid, cid}},
		{"cgroupns with a short cid", "0::/../../pod" + uid + "/c\n", PodCgroup{uid, "c"}},

		// Spoofing: a pod can create cgroups only below its own, so the
		// first pod segment is the real one.
		{"pod-shaped cgroup below another pod's container", "0::/kubepods/besteffort/pod" + uid + "/" + cid + "/pod" + uid2 + "/" + cid2 + "\n", PodCgroup{uid, cid}},
		{"same, relative", "0::/../../pod" + uid + "/" + cid + "/kubepods-pod" + strings.ReplaceAll(uid2, "-", "_") + ".slice/cri-containerd-" + cid2 + ".scope\n", PodCgroup{uid, cid}},
		{"uid inside a longer segment", "0::/kubepods/besteffort/xpod" + uid + "/" + cid + "\n", PodCgroup{}},
		{"uid with a suffix", "0::/kubepods/besteffort/pod" + uid + "x/" + cid + "\n", PodCgroup{}},
		{"cgroupfs pod named like a slice", "0::/kubepods/pod" + uid + ".slice/" + cid + "\n", PodCgroup{}},
		{"slice with a suffix", "0::/kubepods-pod" + uidU + ".slice.bak/cri-containerd-" + cid + ".scope\n", PodCgroup{}},
		{"slice not named after kubepods", "0::/kubepods.slice/foo-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope\n", PodCgroup{}},
		{"slice of an unknown QoS", "0::/kubepods.slice/kubepods-gold-pod" + uidU + ".slice/cri-containerd-" + cid + ".scope\n", PodCgroup{}},
		{"slice with an unescaped uid", "0::/kubepods.slice/kubepods-pod" + uid + ".slice/cri-containerd-" + cid + ".scope\n", PodCgroup{}},
		{"cgroupfs with an escaped uid", "0::/kubepods/pod" + uidU + "/" + cid + "\n", PodCgroup{}},
		{"first pod segment lacks a container", "0::/kubepods/pod" + uid + "/x.y/pod" + uid2 + "/" + cid2 + "\n", PodCgroup{}},
		{"lines name different pods", "8:pids:/kubepods/pod" + uid + "/" + cid + "\n0::/kubepods/pod" + uid2 + "/" + cid + "\n", PodCgroup{}},
		{"lines name different containers", "8:pids:/kubepods/pod" + uid + "/" + cid + "\n0::/kubepods/pod" + uid + "/" + cid2 + "\n", PodCgroup{}},

		// Not a pod's container.
		{"not a pod", "0::/system.slice/containerd.service\n", PodCgroup{}},
		{"pod cgroup itself", "0::/kubepods/burstable/pod" + uid + "\n", PodCgroup{}},
		{"pod slice itself", "0::/kubepods.slice/kubepods-pod" + uidU + ".slice\n", PodCgroup{}},
		{"crio conmon-like scope without id", "0::/kubepods/pod" + uid + "/crio-.scope\n", PodCgroup{}},
		{"qos level only", "0::/kubepods/burstable\n", PodCgroup{}},
		{"removed cgroup", "0::/kubepods/pod" + uid + "/" + cid + " (deleted)\n", PodCgroup{}},
		{"upper-case uid", "0::/kubepods/pod0B7C6F0E-1111-4222-8333-444455556666/" + cid + "\n", PodCgroup{}},
		{"upper-case container id", "0::/kubepods/pod" + uid + "/" + strings.ToUpper(cid) + "\n", PodCgroup{}},
		{"container id too long", "0::/kubepods/pod" + uid + "/" + strings.Repeat("a", 129) + "\n", PodCgroup{}},
		{"short uid", "0::/kubepods/pod0b7c6f0e/" + cid + "\n", PodCgroup{}},
		{"non-hex uid", "0::/kubepods/podzb7c6f0e-1111-4222-8333-444455556666/" + cid + "\n", PodCgroup{}},
		{"dashes misplaced", "0::/kubepods/pod0b7c6f0e1-111-4222-8333-444455556666/" + cid + "\n", PodCgroup{}},
		{"parent segments", "0::/kubepods/pod" + uid + "/../" + cid + "\n", PodCgroup{}},
		{"runtime prefix with odd characters", "0::/kubepods/pod" + uid + "/cri_containerd-" + cid + ".scope\n", PodCgroup{}},
		{"colon form with a bad runtime", "0::/kubepods-pod" + uidU + ".slice:Cri:" + cid + "\n", PodCgroup{}},
		{"colon form without runtime", "0::/kubepods-pod" + uidU + ".slice:" + cid + "\n", PodCgroup{}},

		// Malformed files.
		{"empty", "", PodCgroup{}},
		{"garbage", "\x00\x01:::::\n\n", PodCgroup{}},
		{"one colon", "0:/kubepods/pod" + uid + "/" + cid + "\n", PodCgroup{}},
		{"relative path", "0::kubepods/pod" + uid + "/" + cid + "\n", PodCgroup{}},
		{"non-numeric hierarchy", "x::/kubepods/pod" + uid + "/" + cid + "\n", PodCgroup{}},
		{"a bad line beside a good one", "0::/kubepods/pod" + uid + "/" + cid + "\nnonsense\n", PodCgroup{}},
	}
	for _, c := range cases {
		got, err := ParseCgroup([]byte(c.in))
		if c.want == (PodCgroup{}) {
			if err == nil {
				t.Errorf("%s: accepted as %+v, want rejected", c.name, got)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%s: got %+v, %v; want %+v", c.name, got, err, c.want)
		}
	}
}

func TestParseCgroupErrors(t *testing.T) {
	if _, err := ParseCgroup([]byte("0::/system.slice/x.service\n")); !errors.Is(err, ErrNotPod) {
		t.Errorf("not a pod: err %v, want ErrNotPod", err)
	}
	_, err := ParseCgroup([]byte("8:pids:/kubepods/pod" + uid + "/" + cid + "\n0::/kubepods/pod" + uid2 + "/" + cid + "\n"))
	if err == nil || errors.Is(err, ErrNotPod) || !strings.Contains(err.Error(), uid2) {
		t.Errorf("conflict: err %v, want one naming both pods", err)
	}
	_, err = ParseCgroup([]byte(strings.Repeat("x", 10000)))
	if err == nil || len(err.Error()) > 200 {
		t.Errorf("oversized bad line: err %v, want a short error", err)
	}
}

func FuzzParseCgroup(f *testing.F) {
	fuzzseed.AddDir(f, filepath.Join("testdata", "cgroups"))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := ParseCgroup(b)
		if err != nil {
			if got != (PodCgroup{}) {
				t.Fatalf("error %v with a result %+v", err, got)
			}
			return
		}
		if !isUID(string(got.UID), '-') || !isContainerID(got.ContainerID) {
			t.Fatalf("invalid result %+v", got)
		}
		// The uid was in the input, as kubelet writes it for one driver.
		s := string(b)
		if !strings.Contains(s, "pod"+string(got.UID)) && !strings.Contains(s, "pod"+strings.ReplaceAll(string(got.UID), "-", "_")+".slice") {
			t.Fatalf("uid %s not in the input as a pod segment", got.UID)
		}
		if !strings.Contains(s, got.ContainerID) {
			t.Fatalf("container id %s not in the input", got.ContainerID)
		}
		// Parsing is a function of the lines: repeating them changes nothing.
		again, err := ParseCgroup([]byte(s + "\n" + s))
		if err != nil || again != got {
			t.Fatalf("doubled input: %+v, %v; want %+v", again, err, got)
		}
	})
}

// TestParseCgroupSeeds pins what each seed file parses to, so the fuzz
// corpus keeps covering both accepted and rejected shapes.
func TestParseCgroupSeeds(t *testing.T) {
	want := map[string]types.UID{
		"host-process":            "",
		"hostile":                 "",
		"v1-cgroupfs":             uid,
		"v2-systemd":              uid,
		"cgroupns-v2-cgroupfs":    uid,
		"cgroupns-v1-hybrid":      uid,
		"cgroupns-v2-systemd":     uid,
		"spoof-nested-pod":        uid,
		"conflicting-hierarchies": "",
		"systemd-colon-form":      uid,
	}
	for name, w := range want {
		b, err := os.ReadFile(filepath.Join("testdata/cgroups", name))
		if err != nil {
			t.Fatal(err)
		}
		got, err := ParseCgroup(b)
		if got.UID != w || (w == "") != (err != nil) {
			t.Errorf("%s: got %+v, %v; want uid %q", name, got, err, w)
		}
	}
}
