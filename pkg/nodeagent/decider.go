package nodeagent

import (
	"context"
	"fmt"
	"slices"
	"sync"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
)

// PolicyDecider decides from pod and namespace objects handed to it
// directly, with enablement.Policy. It stands in for the pod controller where
// no API server is involved (tests, a static node).
type PolicyDecider struct {
	Policy enablement.Policy

	mu       sync.Mutex
	pods     map[string]*corev1.Pod
	nss      map[string]*corev1.Namespace
	onChange func()
}

// NewPolicyDecider returns an empty decider using policy.
func NewPolicyDecider(policy enablement.Policy) *PolicyDecider {
	return &PolicyDecider{Policy: policy, pods: map[string]*corev1.Pod{}, nss: map[string]*corev1.Namespace{}}
}

// OnChange registers f to run after every change (e.g. Agent.RefreshSnapshot).
func (d *PolicyDecider) OnChange(f func()) {
	d.mu.Lock()
	d.onChange = f
	d.mu.Unlock()
}

// SetPod adds or replaces a pod.
func (d *PolicyDecider) SetPod(p *corev1.Pod) {
	d.mu.Lock()
	d.pods[p.Namespace+"/"+p.Name] = p.DeepCopy()
	f := d.onChange
	d.mu.Unlock()
	if f != nil {
		f()
	}
}

// DeletePod forgets a pod.
func (d *PolicyDecider) DeletePod(namespace, name string) {
	d.mu.Lock()
	delete(d.pods, namespace+"/"+name)
	f := d.onChange
	d.mu.Unlock()
	if f != nil {
		f()
	}
}

// SetNamespace adds or replaces a namespace.
func (d *PolicyDecider) SetNamespace(ns *corev1.Namespace) {
	d.mu.Lock()
	d.nss[ns.Name] = ns.DeepCopy()
	f := d.onChange
	d.mu.Unlock()
	if f != nil {
		f()
	}
}

// Decide implements Decider. An unknown pod is an error (the runtime is
// starting a pod the decider has not heard of yet: retry).
func (d *PolicyDecider) Decide(_ context.Context, namespace, name, uid string) (enablement.Decision, *corev1.Pod, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	p := d.pods[namespace+"/"+name]
	if p == nil {
		return enablement.Decision{}, nil, fmt.Errorf("pod %s/%s not known", namespace, name)
	}
	if uid != "" && string(p.UID) != uid {
		return enablement.Decision{}, nil, fmt.Errorf("pod %s/%s is uid %s, not %s", namespace, name, p.UID, uid)
	}
	return d.Policy.Decide(p, d.nss[namespace]), p.DeepCopy(), nil
}

// EnablementState implements EnablementSource.
func (d *PolicyDecider) EnablementState() (enabled []string, podLevel bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for name, ns := range d.nss {
		if enablement.NamespaceEnabled(ns) && !d.Policy.IsExcludedNamespace(name) {
			enabled = append(enabled, name)
		}
	}
	slices.Sort(enabled)
	for _, p := range d.pods {
		if p.Labels[ambient.DataplaneModeLabel] == ambient.DataplaneModeAmbient && !slices.Contains(enabled, p.Namespace) {
			podLevel = true
		}
	}
	return enabled, podLevel
}
