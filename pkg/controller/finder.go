package controller

import (
	"fmt"
	"net/netip"

	"github.com/ambient-cni/ambient-cni/pkg/podnetns"
	"k8s.io/apimachinery/pkg/types"
)

// ProcFinder finds pods' network namespaces with one /proc scan; the
// scanner confirms each by one of the pod's IPs inside it and holds it open.
type ProcFinder struct {
	Scanner podnetns.Scanner
}

// Find implements Finder. A pod without IPs cannot be confirmed and is
// left out, as is one whose namespace holds none of its IPs.
func (f ProcFinder) Find(pods map[types.UID][]netip.Addr) (map[types.UID]podnetns.Found, error) {
	return f.Scanner.Find(pods)
}

// heldPath names a held namespace for the path-based Enroller: the
// caller's own descriptor, valid until the caller closes it after the
// Enroller has opened it.
func heldPath(f podnetns.Found) string {
	return fmt.Sprintf("/proc/self/fd/%d", f.File.Fd())
}
