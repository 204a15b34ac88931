package nodeagent

import (
	"log/slog"
	"net/netip"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/podnetns"
)

// ProcFinder finds running pods' network namespaces with one /proc scan,
// confirms each by finding one of the pod's IPs inside it, and opens it:
// the pod controller's find step, between deciding and capturing.
type ProcFinder struct {
	Scanner podnetns.Scanner
	Logger  *slog.Logger
}

// Find returns an open handle per pod UID it could locate, confirm and
// open; the caller owns the handles. A pod without IPs cannot be confirmed
// and is left out, as is one whose namespace holds none of its IPs.
func (f ProcFinder) Find(pods map[types.UID][]netip.Addr) (map[types.UID]*Netns, error) {
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
	out := make(map[types.UID]*Netns, len(found))
	for uid, fd := range found {
		ok, err := podnetns.HoldsAnyOf(fd.Path, pods[types.UID(uid)])
		if err != nil || !ok {
			f.warn("netns found by cgroup does not hold the pod's IPs; not touching it", "uid", uid, "pid", fd.PID, "err", err)
			continue
		}
		ns, err := OpenNetns(fd.Path)
		if err != nil {
			f.warn("cannot open the netns found for a pod", "uid", uid, "pid", fd.PID, "err", err)
			continue
		}
		out[types.UID(uid)] = ns
	}
	return out, nil
}

func (f ProcFinder) warn(msg string, args ...any) {
	if f.Logger != nil {
		f.Logger.Warn(msg, args...)
	}
}
