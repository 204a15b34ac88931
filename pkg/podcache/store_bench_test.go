package podcache

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
)

// BenchmarkNamespaceStore reports what one namespace costs in the
// namespace informer's store (the transform, no index), in heap bytes per
// namespace, for namespaces like bench-scale's: 10 KiB of annotations and
// two labels no default selector reads.
func BenchmarkNamespaceStore(b *testing.B) {
	const n = 10000
	trim := NamespaceTransform(NamespaceLabelKeys(enablement.DefaultPolicy()))
	ann := map[string]string{"bench.ambient-cni.io/note": strings.Repeat("x", 10<<10)}
	var perNS float64
	for b.Loop() {
		store := cache.NewIndexer(cache.DeletionHandlingMetaNamespaceKeyFunc, cache.Indexers{})
		before := heapAlloc()
		for i := range n {
			name := fmt.Sprintf("scale-abcd-%05d", i)
			full := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
				Name: name, UID: types.UID(fmt.Sprintf("0b6c3f6e-4d2a-4c1e-9f7a-%012d", i)), ResourceVersion: fmt.Sprint(100000 + i),
				Labels:      map[string]string{"kubernetes.io/metadata.name": name, "bench.ambient-cni.io/load": "abcd"},
				Annotations: ann,
			}}
			o, err := trim(full)
			if err != nil {
				b.Fatal(err)
			}
			if err := store.Add(o); err != nil {
				b.Fatal(err)
			}
		}
		perNS = float64(heapAlloc()-before) / n
		runtime.KeepAlive(store)
	}
	b.ReportMetric(perNS, "B/namespace")
}

func heapAlloc() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}
