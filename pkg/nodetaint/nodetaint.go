// Package nodetaint holds the startup taint of a node whose CNI agent is
// not ready yet (Istio's cni.istio.io/not-ready:NoSchedule, which kubelet
// puts on the node with --register-with-taints): the JSON patches that
// remove it from, or put it back on, the agent's own node without touching
// any other taint, and the Untainter that removes it once the agent is
// ready to capture.
//
// Each patch carries a JSON-patch test of the taints the agent read, so a
// concurrent change to another taint makes the patch fail instead of being
// lost; the agent then reads the node again and retries. The chart's
// ValidatingAdmissionPolicy lets the agent's ServiceAccount make exactly
// these changes, on its own node only.
package nodetaint

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
)

// Key is the startup taint's key, Istio's: istiod's own untaint controller
// (PILOT_ENABLE_NODE_UNTAINT_CONTROLLERS) removes the same taint.
const Key = "cni.istio.io/not-ready"

// Effect is the startup taint's effect: pods are not scheduled onto the
// node, running ones stay.
const Effect = corev1.TaintEffectNoSchedule

// Taint is the startup taint as kubelet registers it
// (--register-with-taints=cni.istio.io/not-ready=:NoSchedule).
var Taint = corev1.Taint{Key: Key, Effect: Effect}

// DefaultInterval is how often the Untainter asks whether the agent is
// ready.
const DefaultInterval = time.Second

// maxAttempts bounds the read-patch rounds of one Remove or Add: each
// failed round means another writer changed the taints in between.
const maxAttempts = 10

// op is one JSON-patch (RFC 6902) operation.
type op struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value,omitempty"`
}

// isOurs reports whether t is the startup taint (any value: kubelet's flag
// allows one, and it means the same).
func isOurs(t corev1.Taint) bool { return t.Key == Key && t.Effect == Effect }

// Has reports whether taints hold the startup taint.
func Has(taints []corev1.Taint) bool {
	for _, t := range taints {
		if isOurs(t) {
			return true
		}
	}
	return false
}

// RemovePatch returns the JSON patch that removes every startup taint from
// a node whose taints are taints, and nil when there is none. The patch
// tests that the taints are still exactly taints first.
func RemovePatch(taints []corev1.Taint) ([]byte, error) {
	if !Has(taints) {
		return nil, nil
	}
	ops := []op{{Op: "test", Path: "/spec/taints", Value: taints}}
	// From the end, so that each index still names the taint it was read as.
	for i := len(taints) - 1; i >= 0; i-- {
		if isOurs(taints[i]) {
			ops = append(ops, op{Op: "remove", Path: "/spec/taints/" + strconv.Itoa(i)})
		}
	}
	return json.Marshal(ops)
}

// AddPatch returns the JSON patch that appends the startup taint to a node
// whose taints are taints (resourceVersion is the node's, as read), and nil
// when it is there already. The patch tests that the taints are still
// exactly taints, or, on a node without taints, that the node has not
// changed since it was read (a test cannot name a missing list).
func AddPatch(taints []corev1.Taint, resourceVersion string) ([]byte, error) {
	if Has(taints) {
		return nil, nil
	}
	if len(taints) == 0 {
		if resourceVersion == "" {
			return nil, errors.New("add startup taint: node without taints and without a resourceVersion")
		}
		return json.Marshal([]op{
			{Op: "test", Path: "/metadata/resourceVersion", Value: resourceVersion},
			{Op: "add", Path: "/spec/taints", Value: []corev1.Taint{Taint}},
		})
	}
	return json.Marshal([]op{
		{Op: "test", Path: "/spec/taints", Value: taints},
		{Op: "add", Path: "/spec/taints/-", Value: Taint},
	})
}

// Client reads and patches the node (kubeclient.Nodes).
type Client interface {
	GetNode(ctx context.Context, name string) (*corev1.Node, error)
	PatchNode(ctx context.Context, name string, pt types.PatchType, data []byte) (*corev1.Node, error)
}

// Remove removes the startup taint from node, leaving every other taint as
// it is. It reports whether the node had it. A patch whose test fails
// (another writer changed the taints) is retried on a fresh read.
func Remove(ctx context.Context, client Client, node string) (bool, error) {
	return change(ctx, client, node, "remove", func(n *corev1.Node) ([]byte, error) { return RemovePatch(n.Spec.Taints) })
}

// Add puts the startup taint on node, leaving every other taint as it is.
// It reports whether it had to (false: the taint was there).
func Add(ctx context.Context, client Client, node string) (bool, error) {
	return change(ctx, client, node, "add", func(n *corev1.Node) ([]byte, error) {
		return AddPatch(n.Spec.Taints, n.ResourceVersion)
	})
}

func change(ctx context.Context, client Client, node, verb string, build func(*corev1.Node) ([]byte, error)) (bool, error) {
	var last error
	for range maxAttempts {
		n, err := client.GetNode(ctx, node)
		if err != nil {
			return false, fmt.Errorf("%s taint %s: read node %s: %w", verb, Key, node, err)
		}
		patch, err := build(n)
		if err != nil {
			return false, err
		}
		if patch == nil {
			return false, nil
		}
		_, err = client.PatchNode(ctx, node, types.JSONPatchType, patch)
		if err == nil {
			return true, nil
		}
		// A failed test is 422 Invalid, a lost optimistic-concurrency race
		// 409 Conflict: the taints changed under us; read them again.
		if !apierrors.IsInvalid(err) && !apierrors.IsConflict(err) {
			return false, fmt.Errorf("%s taint %s on node %s: %w", verb, Key, node, err)
		}
		last = err
		if err := ctx.Err(); err != nil {
			return false, fmt.Errorf("%s taint %s on node %s: %w", verb, Key, node, err)
		}
	}
	return false, fmt.Errorf("%s taint %s on node %s: the taints kept changing, %d attempts: %w", verb, Key, node, maxAttempts, last)
}

// Untainter removes the startup taint from its node once the agent is
// ready to capture.
type Untainter struct {
	// Client talks to the API server as the agent.
	Client Client
	// Node is the agent's own node.
	Node string
	// Ready lists what is not ready yet; empty means ready to capture.
	Ready func() []string
	// Interval between readiness checks, and between attempts to remove
	// the taint; DefaultInterval when zero.
	Interval time.Duration
	Logger   *slog.Logger
}

// Run waits until Ready reports nothing, then removes the taint, retrying
// until that works or ctx ends. It returns nil once the taint is gone (or
// was never there), and when ctx ends.
func (u Untainter) Run(ctx context.Context) error {
	if u.Client == nil || u.Node == "" || u.Ready == nil {
		return errors.New("untainter: Client, Node and Ready are required")
	}
	log := u.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	every := u.Interval
	if every <= 0 {
		every = DefaultInterval
	}
	tick := time.NewTicker(every)
	defer tick.Stop()
	var lastErr string
	for {
		if failed := u.Ready(); len(failed) == 0 {
			removed, err := Remove(ctx, u.Client, u.Node)
			if err == nil {
				if removed {
					log.Info("startup taint removed: agent ready to capture", "node", u.Node, "taint", Key+":"+string(Effect))
				}
				return nil
			}
			if ctx.Err() != nil {
				return nil
			}
			if err.Error() != lastErr {
				log.Warn("remove startup taint; retrying", "node", u.Node, "err", err)
				lastErr = err.Error()
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
