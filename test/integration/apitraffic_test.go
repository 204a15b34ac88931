package integration

import (
	"context"
	"io"
	"maps"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// apiTraffic counts, per API resource, the agent client's requests (by
// "watch" or the HTTP method) and the bytes its watch streams carried.
type apiTraffic struct {
	mu         sync.Mutex
	requests   map[string]int   // "watch services", "GET daemonsets"...
	watchBytes map[string]int64 // by resource
}

// trafficSnapshot is a copy of the counts.
type trafficSnapshot struct {
	requests   map[string]int
	watchBytes map[string]int64
}

func (a *apiTraffic) roundTrip(rt http.RoundTripper, r *http.Request) (*http.Response, error) {
	res := resourceOf(r.URL.Path)
	verb := r.Method
	watching := r.URL.Query().Get("watch") == "true"
	if watching {
		verb = "watch"
	}
	a.mu.Lock()
	if a.requests == nil {
		a.requests, a.watchBytes = map[string]int{}, map[string]int64{}
	}
	a.requests[verb+" "+res]++
	a.mu.Unlock()
	resp, err := rt.RoundTrip(r)
	if err == nil && watching {
		resp.Body = &countingBody{ReadCloser: resp.Body, add: func(n int) {
			a.mu.Lock()
			a.watchBytes[res] += int64(n)
			a.mu.Unlock()
		}}
	}
	return resp, err
}

func (a *apiTraffic) snapshot() trafficSnapshot {
	a.mu.Lock()
	defer a.mu.Unlock()
	return trafficSnapshot{requests: maps.Clone(a.requests), watchBytes: maps.Clone(a.watchBytes)}
}

// watched names the resources watched, sorted.
func (s trafficSnapshot) watched() []string {
	var out []string
	for k := range s.requests {
		if res, ok := strings.CutPrefix(k, "watch "); ok {
			out = append(out, res)
		}
	}
	slices.Sort(out)
	return out
}

type countingBody struct {
	io.ReadCloser
	add func(int)
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.add(n)
	}
	return n, err
}

// resourceOf is the resource an API path names: /api/v1/namespaces/x/pods
// and /api/v1/pods are "pods", /api/v1/namespaces and
// /api/v1/namespaces/x "namespaces", /apis/apps/v1/namespaces/x/daemonsets/y
// "daemonsets"; any other path is itself.
func resourceOf(path string) string {
	seg := strings.Split(strings.Trim(path, "/"), "/")
	switch {
	case len(seg) >= 3 && seg[0] == "api":
		seg = seg[2:]
	case len(seg) >= 4 && seg[0] == "apis":
		seg = seg[3:]
	default:
		return path
	}
	if len(seg) >= 3 && seg[0] == "namespaces" {
		seg = seg[2:]
	}
	return seg[0]
}

// TestDaemonSetStatusWritesReachNoAgent: the DaemonSet controller writes
// the agent's DaemonSet's status about once per node during an install
// or a rollout; an agent that watched its DaemonSet would get every write,
// events quadratic in the nodes across the cluster. The agent watches
// exactly the pods of its node, the namespaces and the release's signal
// (install-cni's NewAPIWatches), never reads a DaemonSet while it runs, and 30
// status writes bring its watches nothing: once a namespace created after
// them reached the agent, no other watch of it carried more than a
// bookmark's bytes.
func TestDaemonSetStatusWritesReachNoAgent(t *testing.T) {
	n := newNode(t, nodeOptions{Upgrade: true})
	ctx := context.Background()
	before := n.traffic.snapshot()
	dsc := n.env.Client.AppsV1().DaemonSets(n.agentNS)
	const writes = 30
	for i := range writes {
		ds, err := dsc.Get(ctx, n.cfg.DaemonSet, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		ds.Status.DesiredNumberScheduled = writes
		ds.Status.CurrentNumberScheduled = int32(i + 1)
		ds.Status.NumberReady = int32(i + 1)
		ds.Status.ObservedGeneration = ds.Generation
		if _, err := dsc.UpdateStatus(ctx, ds, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	// Every agent gets this one; once it arrived, so had the writes' events
	// on any stream that carried them.
	n.env.CreateNamespace(t, "", nil)
	poll.Within(t, waitLong, "the new namespace on the agent's namespace watch", func() bool {
		return n.traffic.snapshot().watchBytes["namespaces"] > before.watchBytes["namespaces"]
	})
	after := n.traffic.snapshot()
	if got, want := after.watched(), []string{"namespaces", "pods", "services"}; !slices.Equal(got, want) {
		t.Errorf("the agent watches %v, want %v (its node's pods, namespaces, the release's signal)", got, want)
	}
	for k, c := range after.requests {
		if strings.HasSuffix(k, " daemonsets") {
			t.Errorf("the agent made %d %q requests while it runs; it reads its DaemonSet only when it stops", c, k)
		}
	}
	const bookmark = 1 << 10
	for res, b := range after.watchBytes {
		if d := b - before.watchBytes[res]; res != "namespaces" && d > bookmark {
			t.Errorf("%d status writes of the DaemonSet: the agent's %s watch carried %d bytes", writes, res, d)
		}
	}
}
