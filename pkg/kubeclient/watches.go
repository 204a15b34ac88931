package kubeclient

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"
)

// Watch is one list-and-watch the node agent keeps open for its whole
// life: what it asks the API server for, and the informer's ListerWatcher
// and object type that ask it. The agent's informers are built from these
// values and nothing else. Which of them the agent opens is decided in one
// place, install-cni's NewAPIWatches, which the fleet simulator calls for
// each simulated node.
type Watch struct {
	// Name says what it is for: "pods", "namespaces", "release-signal".
	Name string
	// Resource is the API resource ("pods", "namespaces", "services") of
	// Group/Version; Namespace is "" for all namespaces.
	Group, Version, Resource, Namespace string
	// Options are the selectors every list and watch request carries.
	Options metav1.ListOptions
	// MetadataOnly: lists and watches return PartialObjectMetadata, not
	// whole objects.
	MetadataOnly bool
	// ListerWatcher lists and watches as above, for an informer whose
	// objects are of ExpectedType's type.
	ListerWatcher cache.ListerWatcher
	ExpectedType  runtime.Object
}

// PodsOfNodeWatch is the pods of node nodeName, in every namespace (field
// selector spec.nodeName).
func PodsOfNodeWatch(c PodReader, nodeName string) Watch {
	opts := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", nodeName).String()}
	return Watch{
		Name: "pods", Version: "v1", Resource: "pods", Options: opts,
		ListerWatcher: PodListWatch(c, metav1.NamespaceAll, withOptions(opts)),
		ExpectedType:  &corev1.Pod{},
	}
}

// NamespacesWatch is every namespace of the cluster, whole: the API
// server cannot leave annotations or managedFields out of a watch, and a
// metadata-only watch would drop only the spec and status (a few bytes of
// a namespace). What the agent keeps of each is trimmed before it is cached
// (podcache.NamespaceTransform).
func NamespacesWatch(c NamespaceReader) Watch {
	return Watch{
		Name: "namespaces", Version: "v1", Resource: "namespaces",
		ListerWatcher: NamespaceListWatch(c, nil),
		ExpectedType:  &corev1.Namespace{},
	}
}

// ReleaseSignalWatch is the metadata of one Service, name in namespace
// (field selector metadata.name, so RBAC can grant that one object): the
// release's signal. Its deletion is how an agent learns of an uninstall
// before it loses its RBAC. A Service because helm's uninstall deletes
// Services before DaemonSets and RBAC (ConfigMaps and ServiceAccounts go
// after the RBAC); one without selector, ports or cluster IP, which no
// controller writes to, so it carries an event at its creation and at
// its deletion and none between, however many nodes.
func ReleaseSignalWatch(c ServiceMetadataReader, namespace, name string) Watch {
	opts := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()}
	return Watch{
		Name: "release-signal", Version: "v1", Resource: "services", Namespace: namespace,
		Options: opts, MetadataOnly: true,
		ListerWatcher: ServiceMetadataListWatch(c, namespace, withOptions(opts)),
		ExpectedType:  &metav1.PartialObjectMetadata{},
	}
}

// withOptions sets the selectors of opts on every request.
func withOptions(opts metav1.ListOptions) func(*metav1.ListOptions) {
	return func(o *metav1.ListOptions) {
		o.LabelSelector, o.FieldSelector = opts.LabelSelector, opts.FieldSelector
	}
}
