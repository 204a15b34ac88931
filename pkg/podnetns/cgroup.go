// Package podnetns finds the network namespaces of running pods by scanning
// /proc for processes whose cgroup path names the pod UID, the way kubelet
// lays cgroups out. One scan serves a whole batch of pods.
package podnetns

import (
	"bytes"
	"strings"
)

// uidLen is the length of a Kubernetes UID in its canonical UUID form.
const uidLen = 36

// PodUIDFromCgroup returns the pod UID named by the contents of a
// /proc/<pid>/cgroup file, for any hierarchy line (cgroup v1 or v2) and
// either kubelet cgroup driver:
//
//	cgroupfs: .../kubepods/burstable/pod<uid>/<container-id>
//	systemd:  .../kubepods-burstable-pod<uid with underscores>.slice/cri-containerd-<id>.scope
//
// It reports false when no line names a pod.
func PodUIDFromCgroup(content []byte) (string, bool) {
	for len(content) > 0 {
		var line []byte
		line, content, _ = bytes.Cut(content, []byte{'\n'})
		// hierarchy-ID:controllers:path; the path may itself hold colons.
		parts := bytes.SplitN(line, []byte{':'}, 3)
		if len(parts) != 3 {
			continue
		}
		if uid, ok := PodUIDFromPath(string(parts[2])); ok {
			return uid, true
		}
	}
	return "", false
}

// PodUIDFromPath returns the pod UID named by one cgroup path.
func PodUIDFromPath(path string) (string, bool) {
	if !strings.Contains(path, "kubepods") {
		return "", false
	}
	for seg := range strings.SplitSeq(path, "/") {
		if uid, ok := uidFromSegment(seg); ok {
			return uid, true
		}
	}
	return "", false
}

func uidFromSegment(seg string) (string, bool) {
	// systemd driver: kubepods[-qos]-pod<uid_>.slice
	if rest, ok := strings.CutSuffix(seg, ".slice"); ok {
		i := strings.LastIndex(rest, "-pod")
		if i < 0 || !strings.HasPrefix(rest, "kubepods") {
			return "", false
		}
		return canonicalUID(strings.ReplaceAll(rest[i+len("-pod"):], "_", "-"))
	}
	// cgroupfs driver: pod<uid>
	if rest, ok := strings.CutPrefix(seg, "pod"); ok {
		return canonicalUID(rest)
	}
	return "", false
}

// canonicalUID accepts a 36-character UUID (8-4-4-4-12 hex) and returns it
// lower-cased, which is how the API server writes UIDs.
func canonicalUID(s string) (string, bool) {
	if len(s) != uidLen {
		return "", false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch i {
		case 8, 13, 18, 23:
			if c != '-' {
				return "", false
			}
		default:
			if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F') {
				return "", false
			}
		}
	}
	return strings.ToLower(s), true
}
