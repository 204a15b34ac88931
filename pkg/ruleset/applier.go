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

// CheckPodNetns refuses an empty pod netns path, which both backends would
// take for the caller's namespace: for the node agent the host's, never a
// pod's.
func CheckPodNetns(path string) error {
	if path == "" {
		return errors.New("pod netns path is empty")
	}
	return nil
}
