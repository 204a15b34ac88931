package netns

import (
	"bytes"
	"errors"
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/types"
)

// uidLen is the length of a Kubernetes UID in its canonical UUID form.
const uidLen = 36

// maxContainerIDLen bounds a container ID (runtimes use 64 hex digits).
const maxContainerIDLen = 128

// PodCgroup is what a process's cgroup membership says about its pod.
type PodCgroup struct {
	// UID is the pod UID, canonical (lower-case, dashes).
	UID types.UID
	// ContainerID is the runtime's container ID from the container cgroup.
	ContainerID string
}

// ErrNotPod means no line of a cgroup file places the process in a pod's
// container cgroup.
var ErrNotPod = errors.New("cgroup names no pod container")

// ParseCgroup reads the contents of a /proc/<pid>/cgroup file and returns
// the pod and container the process belongs to.
//
// Each line is "hierarchy-ID:controllers:path" (cgroup v1 controllers and
// named hierarchies, or "0::path" for v2). A path is read from its root
// down, and its first pod segment decides: that segment must be exactly one
// kubelet writes, and the segment right below it a container cgroup.
//
//	cgroupfs: pod<uid>/<id>    (e.g. /kubepods/burstable/pod<uid>/<id>)
//	          pod<uid>/crio-<id>
//	systemd:  [<root>-]kubepods[-burstable|-besteffort]-pod<uid_>.slice/<runtime>-<id>.scope
//	          ... -pod<uid_>.slice:<runtime>:<id>   (one segment; systemd path handed to cgroupfs)
//
// Where the segments sit is not checked: a reader in its own cgroup namespace
// sees other pods relative to its own cgroup, e.g. /../../pod<uid>/<id>,
// with no "kubepods" left in the path. Segments below the container cgroup
// (a container's own sub-cgroups) are allowed; they cannot rename the pod,
// because the first pod segment decides and a pod can only create cgroups
// below its own. Lines naming no pod are ignored (hybrid hosts have root
// paths in unused hierarchies); lines that name a pod must all name the same
// pod and container, else the process is rejected.
//
// It returns ErrNotPod when no line names a pod, and another error for a
// file that is malformed or contradicts itself.
func ParseCgroup(content []byte) (PodCgroup, error) {
	var got PodCgroup
	for n := 1; len(content) > 0; n++ {
		var line []byte
		line, content, _ = bytes.Cut(content, []byte{'\n'})
		if len(line) == 0 {
			continue
		}
		id, rest, ok1 := bytes.Cut(line, []byte{':'})
		_, path, ok2 := bytes.Cut(rest, []byte{':'})
		if !ok1 || !ok2 || !isDigits(id) || len(path) == 0 || path[0] != '/' {
			return PodCgroup{}, fmt.Errorf("cgroup line %d is not hierarchy-ID:controllers:/path: %.80q", n, line)
		}
		pc, ok := parsePath(string(path))
		if !ok {
			continue
		}
		switch {
		case got.UID == "":
			got = pc
		case pc != got:
			return PodCgroup{}, fmt.Errorf("cgroup lines disagree: pod %s container %.16s vs pod %s container %.16s",
				got.UID, got.ContainerID, pc.UID, pc.ContainerID)
		}
	}
	if got.UID == "" {
		return PodCgroup{}, ErrNotPod
	}
	return got, nil
}

// parsePath applies ParseCgroup's rules to one absolute cgroup path.
func parsePath(path string) (PodCgroup, bool) {
	// cgroup v2 marks the path of a removed cgroup; its process is dying.
	if strings.HasSuffix(path, " (deleted)") {
		return PodCgroup{}, false
	}
	segs := strings.Split(path[1:], "/")
	for i, seg := range segs {
		if uid, ok := cgroupfsPod(seg); ok {
			return withContainer(uid, segs[i+1:])
		}
		if uid, ok := systemdPod(seg); ok {
			return withContainer(uid, segs[i+1:])
		}
		// A systemd cgroup path applied literally by a runtime on the
		// cgroupfs driver: "<pod slice>:<runtime>:<id>", one segment.
		if slice, tail, ok := strings.Cut(seg, ":"); ok {
			if uid, ok := systemdPod(slice); ok {
				runtime, id, ok := strings.Cut(tail, ":")
				if !ok || !isRuntime(runtime) || !isContainerID(id) {
					return PodCgroup{}, false
				}
				return PodCgroup{UID: uid, ContainerID: id}, true
			}
		}
	}
	return PodCgroup{}, false
}

// withContainer requires the segment below a pod segment to be a container
// cgroup.
func withContainer(uid types.UID, below []string) (PodCgroup, bool) {
	if len(below) == 0 {
		return PodCgroup{}, false
	}
	id, ok := containerID(below[0])
	if !ok {
		return PodCgroup{}, false
	}
	return PodCgroup{UID: uid, ContainerID: id}, true
}

// cgroupfsPod matches kubelet's cgroupfs pod cgroup: exactly "pod<uid>".
func cgroupfsPod(seg string) (types.UID, bool) {
	rest, ok := strings.CutPrefix(seg, "pod")
	if !ok || !isUID(rest, '-') {
		return "", false
	}
	return types.UID(rest), true
}

// systemdPod matches kubelet's systemd pod slice: the slice names repeat
// their parents, so it ends in kubepods-pod<uid_>.slice (Guaranteed) or
// kubepods-<burstable|besteffort>-pod<uid_>.slice, optionally after the
// cgroup root's own slice name; systemd escapes the uid's dashes.
func systemdPod(seg string) (types.UID, bool) {
	rest, ok := strings.CutSuffix(seg, ".slice")
	if !ok || len(rest) < uidLen {
		return "", false
	}
	uid := rest[len(rest)-uidLen:]
	if !isUID(uid, '_') {
		return "", false
	}
	prefix := rest[:len(rest)-uidLen]
	for _, p := range []string{"kubepods-pod", "kubepods-burstable-pod", "kubepods-besteffort-pod"} {
		if prefix == p || strings.HasSuffix(prefix, "-"+p) && len(prefix) > len(p)+1 {
			return types.UID(strings.ReplaceAll(uid, "_", "-")), true
		}
	}
	return "", false
}

// containerID matches a container cgroup: "<id>" (containerd, docker on
// cgroupfs), "<runtime>-<id>" (CRI-O on cgroupfs) or
// "<runtime>-<id>.scope" (systemd: cri-containerd-, crio-, docker-).
func containerID(seg string) (string, bool) {
	if isContainerID(seg) {
		return seg, true
	}
	name := strings.TrimSuffix(seg, ".scope")
	i := strings.LastIndexByte(name, '-')
	if i < 0 || !isRuntime(name[:i]) || !isContainerID(name[i+1:]) {
		return "", false
	}
	return name[i+1:], true
}

// isUID reports whether s is a lower-case UUID (8-4-4-4-12 hex digits)
// whose groups are separated by sep. The API server generates lower-case
// UIDs, and kubelet writes them as they are.
func isUID(s string, sep byte) bool {
	if len(s) != uidLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch i {
		case 8, 13, 18, 23:
			if c != sep {
				return false
			}
		default:
			if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
				return false
			}
		}
	}
	return true
}

// isContainerID accepts 1 to maxContainerIDLen lower-case letters and
// digits; runtimes use 64 hex digits.
func isContainerID(s string) bool {
	if len(s) == 0 || len(s) > maxContainerIDLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'z') {
			return false
		}
	}
	return true
}

// isRuntime accepts a runtime's cgroup prefix: lower-case words joined by
// dashes ("cri-containerd", "crio", "docker").
func isRuntime(s string) bool {
	if len(s) == 0 || len(s) > 32 || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= 'a' && c <= 'z' || c == '-') {
			return false
		}
	}
	return true
}

func isDigits(b []byte) bool {
	if len(b) == 0 {
		return false
	}
	for _, c := range b {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}
