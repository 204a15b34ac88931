package controller

import (
	"log/slog"
	"net/netip"

	"github.com/ambient-cni/ambient-cni/pkg/podnetns"
	"k8s.io/apimachinery/pkg/types"
)

// ProcFinder finds pods' network namespaces with one /proc scan and
// confirms each by finding one of the pod's IPs inside it.
type ProcFinder struct {
	Scanner podnetns.Scanner
	Logger  *slog.Logger
}

// Find implements Finder. A pod without IPs cannot be confirmed and is
// left out, as is one whose namespace holds none of its IPs.
func (f ProcFinder) Find(pods map[types.UID][]netip.Addr) (map[types.UID]string, error) {
	want := make(map[string]bool, len(pods))
	for uid, ips := range pods {
		if len(ips) > 0 {
			want[string(uid)] = true
		}
	}
	found, err := f.Scanner.Scan(want)
	if err != nil {
		return nil, err
	}
	out := make(map[types.UID]string, len(found))
	for uid, fd := range found {
		ok, err := podnetns.HoldsAnyOf(fd.Path, pods[types.UID(uid)])
		if err != nil || !ok {
			if f.Logger != nil {
				f.Logger.Warn("netns found by cgroup does not hold the pod's IPs; not touching it",
					"uid", uid, "pid", fd.PID, "err", err)
			}
			continue
		}
		out[types.UID(uid)] = fd.Path
	}
	return out, nil
}
