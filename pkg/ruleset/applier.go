package ruleset

// Applier installs, verifies and removes one pod's rules inside the
// network namespace at a path: what each backend implements and what the
// node agent drives (pkg/rulesbackend picks the backend).
type Applier interface {
	Apply(netnsPath string, cfg PodConfig) error
	Verify(netnsPath string, cfg PodConfig) (Drift, error)
	Remove(netnsPath string) error
}
