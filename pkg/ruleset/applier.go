package ruleset

import "errors"

// Applier installs, verifies and removes one pod's rules inside the
// network namespace at a path: what each backend implements and what the
// node agent drives (pkg/rulesbackend picks the backend).
type Applier interface {
	Apply(netnsPath string, cfg PodConfig) error
	Verify(netnsPath string, cfg PodConfig) (Drift, error)
	Remove(netnsPath string) error
}

// GenVerifier is an Applier whose Verify can skip re-reading a pod's
// netfilter state when the kernel says it has not changed (the
// namespace's nf_tables generation): proving a pod again and again then
// costs a few netlink round trips, not a full read.
type GenVerifier interface {
	// VerifyGen is Verify. gen is the generation an earlier VerifyGen of
	// the same cfg in the same namespace returned with an empty drift (0:
	// none); while the namespace's generation is still gen, its netfilter
	// state is not read again (its policy routes still are). It returns
	// the generation its result holds for: 0 when it cannot tell (the
	// state lives outside nf_tables), and then every call reads in full.
	VerifyGen(netnsPath string, cfg PodConfig, gen uint32) (Drift, uint32, error)
}

// CheckPodNetns refuses an empty pod netns path, which both backends would
// take for the caller's namespace: for the node agent the host's, never a
// pod's.
func CheckPodNetns(path string) error {
	if path == "" {
		return errors.New("pod netns path is empty")
	}
	return nil
}
