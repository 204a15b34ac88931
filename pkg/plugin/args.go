package plugin

import (
	"fmt"
	"os"

	"github.com/containernetworking/cni/pkg/types"
)

// K8sArgs are the Kubernetes keys the runtime passes in CNI_ARGS. The field
// names are the wire keys, as types.LoadArgs requires.
type K8sArgs struct {
	types.CommonArgs
	// K8S_POD_NAME is the pod's name.
	K8S_POD_NAME types.UnmarshallableString
	// K8S_POD_NAMESPACE is the pod's namespace.
	K8S_POD_NAMESPACE types.UnmarshallableString
	// K8S_POD_UID is the pod's UID (older runtimes omit it).
	K8S_POD_UID types.UnmarshallableString
	// K8S_POD_INFRA_CONTAINER_ID is the sandbox (pause) container id.
	K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString
}

// ParseK8sArgs decodes CNI_ARGS. Keys meant for other plugins in the chain
// are ignored rather than rejected.
func ParseK8sArgs(s string) (*K8sArgs, error) {
	a := &K8sArgs{CommonArgs: types.CommonArgs{IgnoreUnknown: true}}
	if err := types.LoadArgs(s, a); err != nil {
		return nil, types.NewError(types.ErrInvalidEnvironmentVariables, "parse CNI_ARGS: "+err.Error(), "")
	}
	return a, nil
}

// requirePod reports a clear error unless the args name a pod.
func (a *K8sArgs) requirePod() error {
	if a.K8S_POD_NAME == "" || a.K8S_POD_NAMESPACE == "" {
		return types.NewError(types.ErrInvalidEnvironmentVariables,
			fmt.Sprintf("CNI_ARGS lacks K8S_POD_NAME or K8S_POD_NAMESPACE (name %q, namespace %q): ambient-cni only handles Kubernetes pods; is it chained in a conflist used by a Kubernetes runtime?",
				a.K8S_POD_NAME, a.K8S_POD_NAMESPACE), "")
	}
	return nil
}

// GuardNetnsEnv keeps the CNI library's own check of CNI_NETNS after ADD
// and DEL (it opens the path, blocking, to compare it with the plugin's
// namespace) from hanging on a FIFO or acting on a device: when CNI_NETNS
// names anything but a regular file (a namespace file is one), it sets
// CNI_NETNS_OVERRIDE so the library skips the check. The plugin never
// enters the namespace; the agent validates the path itself.
func GuardNetnsEnv(getenv func(string) string, setenv func(string, string) error) error {
	p := getenv("CNI_NETNS")
	if p == "" {
		return nil
	}
	st, err := os.Stat(p) // stat never opens, so it cannot block
	if err != nil || st.Mode().IsRegular() {
		return nil
	}
	return setenv("CNI_NETNS_OVERRIDE", "1")
}
