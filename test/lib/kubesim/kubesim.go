// Package kubesim plays kubelet and the container runtime for tests: it
// binds Pod objects to a test node, and for each pod creates a network
// namespace, runs CNI ADD through libcni with the node's real conflist,
// starts a long-lived process in that namespace inside a kubelet-shaped
// cgroup carrying the pod UID, and writes the pod's status (IPs, Running)
// to the API server. Deleting a pod runs CNI DEL, kills the process and
// removes the namespace and the object.
package kubesim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/ambient-cni/ambient-cni/test/lib/podproc"
	"github.com/ambient-cni/ambient-cni/test/lib/testnet"
	"github.com/containernetworking/cni/libcni"
	types100 "github.com/containernetworking/cni/pkg/types/100"
	"github.com/containernetworking/plugins/pkg/ns"
	"github.com/containernetworking/plugins/pkg/testutils"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
)

// T is what a Node needs from its owner: testing.TB satisfies it, and so
// can a program (the local sandbox) that runs cleanups on exit.
type T interface {
	Helper()
	Cleanup(func())
	TempDir() string
	Fatalf(format string, args ...any)
}

// Node is one simulated kubelet.
type Node struct {
	Name   string
	Client kubernetes.Interface
	CNI    *libcni.CNIConfig
	Conf   *libcni.NetworkConfigList
	// Driver is the cgroup layout of pods' processes.
	Driver podproc.Driver
	// PIDNamespace, when set, is the PID namespace (/proc/<pid>/ns/pid)
	// pods' processes start in: a node agent in a PID namespace of its own
	// finds running pods in its /proc only when they live there.
	PIDNamespace string

	t          T
	cgroupRoot string
	mu         sync.Mutex
	// pods are the running sandboxes by sandbox id: a pod whose sandbox
	// is started again while its old one runs (a runtime's restart) has
	// both, and both are torn down when the test ends.
	pods map[string]*Pod
}

// Pod is a pod running on a Node.
type Pod struct {
	Obj       *corev1.Pod
	NS        ns.NetNS
	SandboxID string
	IPs       []netip.Addr
	Result    *types100.Result
	proc      *podproc.Sandbox
}

// NewNode creates a node named name whose runtime uses cniPaths and the
// conflist bytes. Pods still running when the test ends are torn down.
func NewNode(t T, client kubernetes.Interface, name string, cniPaths []string, conflist []byte) *Node {
	t.Helper()
	conf, err := libcni.ConfListFromBytes(conflist)
	if err != nil {
		t.Fatalf("kubesim: parse conflist: %v", err)
	}
	n := &Node{
		Name: name, Client: client, Conf: conf,
		CNI:        libcni.NewCNIConfigWithCacheDir(cniPaths, t.TempDir(), nil),
		t:          t,
		cgroupRoot: testnet.RandName("kubepods-sim-", 8),
		pods:       map[string]*Pod{},
	}
	t.Cleanup(func() {
		n.mu.Lock()
		pods := make([]*Pod, 0, len(n.pods))
		for _, p := range n.pods {
			pods = append(pods, p)
		}
		n.mu.Unlock()
		for _, p := range pods {
			_ = n.Teardown(context.Background(), p)
		}
	})
	return n
}

// CgroupRoot is the node's own cgroup root segment (kubepods-sim-<random>)
// under each cgroup hierarchy: every pod cgroup of the node lies below it.
func (n *Node) CgroupRoot() string { return n.cgroupRoot }

func (n *Node) rt(p *Pod) *libcni.RuntimeConf {
	return &libcni.RuntimeConf{
		ContainerID: p.SandboxID,
		NetNS:       p.NS.Path(),
		IfName:      "eth0",
		Args: [][2]string{
			{"IgnoreUnknown", "1"},
			{"K8S_POD_NAMESPACE", p.Obj.Namespace},
			{"K8S_POD_NAME", p.Obj.Name},
			{"K8S_POD_INFRA_CONTAINER_ID", p.SandboxID},
			{"K8S_POD_UID", string(p.Obj.UID)},
		},
	}
}

// Create stores the Pod object bound to this node (nodeName set, no
// service-account token), as a scheduler would, without running it.
func (n *Node) Create(ctx context.Context, pod *corev1.Pod) (*corev1.Pod, error) {
	pod = pod.DeepCopy()
	pod.Spec.NodeName = n.Name
	f := false
	pod.Spec.AutomountServiceAccountToken = &f
	if len(pod.Spec.Containers) == 0 {
		pod.Spec.Containers = []corev1.Container{{Name: "app", Image: "docker.io/local/app:1", ImagePullPolicy: corev1.PullNever}}
	}
	return n.Client.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{})
}

// Run creates the pod object and starts it. A failed CNI ADD is returned
// (after the runtime's cleanup: DEL and netns removal), like a sandbox
// creation failure the kubelet would retry; see Start to retry on an
// existing object.
func (n *Node) Run(ctx context.Context, pod *corev1.Pod) (*Pod, error) {
	obj, err := n.Create(ctx, pod)
	if err != nil {
		return nil, fmt.Errorf("create pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return n.Start(ctx, obj)
}

// Start runs the sandbox for an existing pod object: netns, CNI ADD,
// process in the pod cgroup, status Running with the pod IPs.
func (n *Node) Start(ctx context.Context, obj *corev1.Pod) (*Pod, error) {
	p, err := n.StartSandbox(ctx, obj)
	if err != nil {
		return nil, err
	}
	if err := n.SetStatus(ctx, p, corev1.PodRunning); err != nil {
		return nil, err
	}
	return p, nil
}

// StartSandbox is Start without the status write, as a kubelet that
// cannot reach the API server runs a pod it already knows: the caller
// writes the status (SetStatus) once it can. A failed CNI ADD is cleaned
// up (DEL, netns removed) and returned; the error wraps the plugin's
// *types.Error.
func (n *Node) StartSandbox(ctx context.Context, obj *corev1.Pod) (*Pod, error) {
	netns, err := testutils.NewNS()
	if err != nil {
		return nil, fmt.Errorf("create netns: %w", err)
	}
	p := &Pod{Obj: obj, NS: netns, SandboxID: testnet.RandName("", 64)}
	// Runtimes bring the sandbox's loopback up (containerd runs the
	// loopback plugin before the network's chain).
	if err := testnet.LoopbackUp(netns); err != nil {
		_ = n.closeNS(p)
		return nil, fmt.Errorf("bring up lo: %w", err)
	}
	res, err := n.CNI.AddNetworkList(ctx, n.Conf, n.rt(p))
	if err != nil {
		_ = n.CNI.DelNetworkList(ctx, n.Conf, n.rt(p))
		_ = n.closeNS(p)
		return nil, fmt.Errorf("CNI ADD for %s/%s: %w", obj.Namespace, obj.Name, err)
	}
	if p.Result, err = types100.NewResultFromResult(res); err != nil {
		return nil, n.fail(ctx, p, fmt.Errorf("convert CNI result: %w", err))
	}
	for _, ipc := range p.Result.IPs {
		if a, ok := netip.AddrFromSlice(ipc.Address.IP); ok {
			p.IPs = append(p.IPs, a.Unmap())
		}
	}
	if p.proc, err = podproc.Start(string(obj.UID), netns.Path(), podproc.Options{Driver: n.Driver, Root: n.cgroupRoot, PIDNamespace: n.PIDNamespace}); err != nil {
		return nil, n.fail(ctx, p, err)
	}
	n.mu.Lock()
	n.pods[p.SandboxID] = p
	n.mu.Unlock()
	return p, nil
}

func (n *Node) fail(ctx context.Context, p *Pod, err error) error {
	_ = n.CNI.DelNetworkList(ctx, n.Conf, n.rt(p))
	if p.proc != nil {
		p.proc.Stop()
	}
	_ = n.closeNS(p)
	return err
}

// closeNS releases the pod's netns and removes its mount.
func (n *Node) closeNS(p *Pod) error { return testnet.RemoveNS(p.NS) }

// SetStatus writes the pod's phase, IPs and Ready condition to the API,
// as kubelet's status manager does. The IPs replace what the status held
// (a merge patch replaces lists): a recreated sandbox's new IP is the
// pod's only one.
func (n *Node) SetStatus(ctx context.Context, p *Pod, phase corev1.PodPhase) error {
	st := corev1.PodStatus{Phase: phase, HostIP: "127.0.0.1", StartTime: &metav1.Time{Time: time.Now()}}
	for _, a := range p.IPs {
		st.PodIPs = append(st.PodIPs, corev1.PodIP{IP: a.String()})
	}
	if len(p.IPs) > 0 {
		st.PodIP = p.IPs[0].String()
	}
	ready := corev1.ConditionTrue
	if phase != corev1.PodRunning {
		ready = corev1.ConditionFalse
	}
	st.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: ready, LastTransitionTime: metav1.Now()}}
	patch, err := json.Marshal(map[string]any{"status": st})
	if err != nil {
		return err
	}
	obj, err := n.Client.CoreV1().Pods(p.Obj.Namespace).Patch(ctx, p.Obj.Name, types.MergePatchType, patch, metav1.PatchOptions{}, "status")
	if err != nil {
		return fmt.Errorf("update status of %s/%s: %w", p.Obj.Namespace, p.Obj.Name, err)
	}
	p.Obj = obj
	return nil
}

// Delete deletes the pod the way a user and kubelet do together: a
// graceful API delete marks the object (deletionTimestamp) while it stays,
// kubelet tears the sandbox down (CNI DEL, process killed, netns removed),
// then removes the object for good (grace period 0).
func (n *Node) Delete(ctx context.Context, p *Pod) error {
	grace := int64(30)
	pods := n.Client.CoreV1().Pods(p.Obj.Namespace)
	uid := metav1.Preconditions{UID: &p.Obj.UID}
	if err := pods.Delete(ctx, p.Obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &grace, Preconditions: &uid}); err != nil {
		return fmt.Errorf("delete pod %s/%s: %w", p.Obj.Namespace, p.Obj.Name, err)
	}
	if err := n.Teardown(ctx, p); err != nil {
		return err
	}
	zero := int64(0)
	if err := pods.Delete(ctx, p.Obj.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero, Preconditions: &uid}); err != nil {
		return fmt.Errorf("remove pod %s/%s: %w", p.Obj.Namespace, p.Obj.Name, err)
	}
	return nil
}

// Finish marks the pod Succeeded and tears its sandbox down, as kubelet
// does for a pod whose containers all exited; the object stays.
func (n *Node) Finish(ctx context.Context, p *Pod) error {
	if err := n.SetStatus(ctx, p, corev1.PodSucceeded); err != nil {
		return err
	}
	return n.Teardown(ctx, p)
}

// Teardown removes the pod's sandbox (CNI DEL, process killed, netns
// removed) and leaves the object alone, as when a runtime loses a sandbox
// under a pod the API still shows running. Tearing down twice is a no-op.
func (n *Node) Teardown(ctx context.Context, p *Pod) error {
	n.mu.Lock()
	_, ok := n.pods[p.SandboxID]
	delete(n.pods, p.SandboxID)
	n.mu.Unlock()
	if !ok {
		return nil
	}
	err := n.CNI.DelNetworkList(ctx, n.Conf, n.rt(p))
	p.proc.Stop()
	nsErr := n.closeNS(p)
	if err != nil {
		err = fmt.Errorf("CNI DEL for %s/%s: %w", p.Obj.Namespace, p.Obj.Name, err)
	}
	return errors.Join(err, nsErr)
}

// DelAgain runs CNI DEL of p's sandbox, already torn down, once more
// through the node's current conflist, as a runtime repeats it when it
// removes a stopped sandbox or cleans up a dead one (its netns is gone by
// then).
func (n *Node) DelAgain(ctx context.Context, p *Pod) error {
	if err := n.CNI.DelNetworkList(ctx, n.Conf, n.rt(p)); err != nil {
		return fmt.Errorf("CNI DEL again for %s/%s: %w", p.Obj.Namespace, p.Obj.Name, err)
	}
	return nil
}

// Addr returns the pod's first IP of the given family (4 or 6).
func (p *Pod) Addr(family int) netip.Addr {
	for _, a := range p.IPs {
		if (family == 6) == a.Is6() {
			return a
		}
	}
	return netip.Addr{}
}
