package plugin

import (
	"fmt"

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
