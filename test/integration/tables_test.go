package integration

import (
	"context"
	"maps"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/test/lib/kubesim"
	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// TestPerPodTablesEmptyAfterPodsGo: whatever the agent remembers per pod
// (state, locks, annotation writes, released sandboxes, torn namespaces,
// records) returns to its starting size once the pods are gone, however
// they went: deleted while enrolled, finished (a Job's pod) then deleted,
// unenrolled then deleted. Memory is bounded by the pods that exist.
func TestPerPodTablesEmptyAfterPodsGo(t *testing.T) {
	n := newNode(t, nodeOptions{})
	agent := n.d.Agent()
	start := agent.TableSizes()
	shop := n.namespace("shop", ambientLabel)
	ctx := context.Background()
	zero := int64(0)
	forceDelete := func(p *kubesim.Pod) error {
		return n.env.Client.CoreV1().Pods(p.Obj.Namespace).Delete(ctx, p.Obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero})
	}
	var pods []*kubesim.Pod
	for _, name := range []string{"deleted", "job", "unenrolled"} {
		pods = append(pods, n.runPod(podSpec(shop, name, nil, nil)))
	}
	n.waitEnrolled(waitLong, pods...)
	if got := agent.TableSizes(); maps.Equal(got, start) {
		t.Fatalf("tables %v did not grow with three enrolled pods", got)
	}
	deleted, job, unenrolled := pods[0], pods[1], pods[2]
	if err := n.kube.Delete(ctx, deleted); err != nil {
		t.Fatal(err)
	}
	if err := n.kube.Finish(ctx, job); err != nil {
		t.Fatal(err)
	}
	n.setPodMode(unenrolled, ambient.DataplaneModeNone)
	n.waitUnenrolled(unenrolled)
	// The finished pod's sandbox is gone: released once ztunnel lost it
	// and its annotation went.
	poll.Within(t, waitLong, "the finished pod released", func() bool {
		_, served := n.zt.Workload(string(job.Obj.UID))
		return !served && n.annotation(job) == ""
	})
	if err := forceDelete(job); err != nil {
		t.Fatal(err)
	}
	if err := n.kube.Delete(ctx, unenrolled); err != nil {
		t.Fatal(err)
	}
	var last map[string]int
	poll.Within(t, waitLong, "every per-pod table back to its starting size", func() bool {
		last = agent.TableSizes()
		return maps.Equal(last, start)
	})
	t.Logf("tables at start %v, after the pods went %v", start, last)
}
