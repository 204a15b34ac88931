package podnetns

import (
	"os"
	"path/filepath"
	"testing"
)

const uid = "0b7c6f0e-1111-4222-8333-444455556666"

func TestPodUIDFromCgroup(t *testing.T) {
	cases := []struct {
		name, in string
		want     string
	}{
		{"v1 cgroupfs burstable", "12:memory:/kubepods/burstable/pod" + uid + "/abc123\n", uid},
		{"v1 cgroupfs guaranteed", "4:pids:/kubepods/pod" + uid + "/abc123\n", uid},
		{"v1 cgroupfs nested root", "4:pids:/kubelet/kubepods/besteffort/pod" + uid + "/abc\n", uid},
		{"v2 cgroupfs", "0::/kubepods/besteffort/pod" + uid + "/ctr\n", uid},
		{"v2 systemd", "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b7c6f0e_1111_4222_8333_444455556666.slice/cri-containerd-abc.scope\n", uid},
		{"v1 systemd guaranteed", "1:name=systemd:/kubepods.slice/kubepods-pod0b7c6f0e_1111_4222_8333_444455556666.slice/cri-containerd-abc.scope\n", uid},
		{"upper case uid", "0::/kubepods/pod0B7C6F0E-1111-4222-8333-444455556666/x", uid},
		{"mixed lines, first is root", "9:name=systemd:/\n8:pids:/kubepods/pod" + uid + "/c\n0::/\n", uid},
		{"not a pod", "0::/system.slice/containerd.service\n", ""},
		{"pod dir outside kubepods", "0::/mypods/pod" + uid + "/c\n", ""},
		{"qos level only", "0::/kubepods/burstable\n", ""},
		{"short uid", "0::/kubepods/pod0b7c6f0e/c\n", ""},
		{"non-hex uid", "0::/kubepods/podzb7c6f0e-1111-4222-8333-444455556666/c\n", ""},
		{"dashes misplaced", "0::/kubepods/pod0b7c6f0e1-111-4222-8333-444455556666/c\n", ""},
		{"slice without kubepods prefix", "0::/kubepods.slice/foo-pod0b7c6f0e_1111_4222_8333_444455556666.slice/x\n", ""},
		{"empty", "", ""},
		{"garbage", "\x00\x01:::::\n\n", ""},
		{"path with colon", "0::/kubepods/pod" + uid + "/a:b\n", uid},
	}
	for _, c := range cases {
		got, ok := PodUIDFromCgroup([]byte(c.in))
		if got != c.want || ok != (c.want != "") {
			t.Errorf("%s: got %q %v, want %q", c.name, got, ok, c.want)
		}
	}
}

func FuzzPodUIDFromCgroup(f *testing.F) {
	seeds, _ := filepath.Glob("testdata/cgroups/*")
	for _, p := range seeds {
		b, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		uid, ok := PodUIDFromCgroup(b)
		if ok {
			if _, valid := canonicalUID(uid); !valid || len(uid) != uidLen {
				t.Fatalf("returned invalid uid %q", uid)
			}
		}
	})
}
