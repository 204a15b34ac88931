package nodeagent

import (
	"log/slog"
	"net/netip"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/podnetns"
)

// ProcFinder finds running pods' network namespaces with one /proc scan and
// turns each into a netns handle: the pod controller's find step, between
// deciding and capturing. The scanner confirms a namespace (not the host's,
// holds one of the pod's IPs) on the descriptor it opened, and the handle is
// built from that very descriptor, never by opening a /proc/<pid> path again,
// so a PID that exits or is reused after the check cannot swap the namespace.
type ProcFinder struct {
	Scanner podnetns.Scanner
	// Logger receives a warning for each checked namespace that could not
	// become a handle; nil discards them.
	Logger *slog.Logger
}

// Find returns an open handle per pod UID it could locate and confirm; the
// caller owns the handles. A pod without IPs cannot be confirmed and is left
// out, as is one whose namespace holds none of its IPs.
func (f ProcFinder) Find(pods map[types.UID][]netip.Addr) (map[types.UID]*Netns, error) {
	found, err := f.Scanner.Find(pods)
	if err != nil {
		return nil, err
	}
	out := make(map[types.UID]*Netns, len(found))
	for uid, fd := range found {
		ns, err := adoptNetns(fd.File)
		if err != nil {
			if f.Logger != nil {
				f.Logger.Warn("cannot hold the netns found for a pod", "uid", uid, "pid", fd.PID, "err", err)
			}
			continue
		}
		out[uid] = ns
	}
	return out, nil
}
