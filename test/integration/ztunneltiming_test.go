package integration

import (
	"testing"

	"github.com/ambient-cni/ambient-cni/test/lib/poll"
)

// TestZtunnelTimingMetrics: /metrics carries the time from the agent's
// start to its first ztunnel (observed once the stand-in acked its
// snapshot) and, for an ADD the plugin sent through the runtime, the
// time from the ADD's arrival to ztunnel's ack of the pod.
func TestZtunnelTimingMetrics(t *testing.T) {
	n := newNode(t, nodeOptions{})
	poll.Within(t, waitLong, "the agent's start to its first ztunnel observed", func() bool {
		return n.metric(`ambient_cni_start_to_ztunnel_seconds_count`) == 1
	})
	if s := n.metric(`ambient_cni_start_to_ztunnel_seconds_sum`); s <= 0 {
		t.Errorf("start to first ztunnel: sum %v, want a positive time", s)
	}
	acks := n.metric(`ambient_cni_cni_add_ztunnel_ack_seconds_count`)

	p := n.runPod(podSpec(n.namespace("shop", ambientLabel), "a", nil, nil))
	n.waitEnrolled(waitLong, p)
	if got := n.metric(`ambient_cni_cni_add_ztunnel_ack_seconds_count`); got != acks+1 {
		t.Errorf("ADD to ztunnel ack observed %v -> %v times, want one more for the pod's ADD", acks, got)
	}
	if s := n.metric(`ambient_cni_cni_add_ztunnel_ack_seconds_sum`); s <= 0 {
		t.Errorf("ADD to ztunnel ack: sum %v, want a positive time", s)
	}
	n.runPod(podSpec(n.namespace("plain", nil), "b", nil, nil)) // its ADD is done when it runs
	if got := n.metric(`ambient_cni_cni_add_ztunnel_ack_seconds_count`); got != acks+1 {
		t.Errorf("an ADD of a pod outside the mesh was observed as a ztunnel ack (%v, want %v)", got, acks+1)
	}
	if got := n.metric(`ambient_cni_start_to_ztunnel_seconds_count`); got != 1 {
		t.Errorf("start to first ztunnel observed %v times, want once per start", got)
	}
}
