package apicalls

import (
	"context"
	"fmt"
	"log/slog"
	"sync"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/tools/cache"

	"github.com/ambient-cni/ambient-cni/pkg/dsplacement"
	"github.com/ambient-cni/ambient-cni/pkg/kubeclient"
)

// UpgradeChecker tells whether a shutdown is part of an upgrade: the
// agent's DaemonSet still exists and is not being deleted.
// DaemonSetUpgradeChecker is the one install-cni uses.
type UpgradeChecker interface {
	IsUpgrade(ctx context.Context) (bool, error)
}

// IsUpgrade asks c and errs on the side of an upgrade: when c is nil or
// fails, the plugin stays in place (new pods then wait for the next agent
// instead of starting uncaptured) and the reason is logged.
func IsUpgrade(ctx context.Context, c UpgradeChecker, log *slog.Logger) bool {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if c == nil {
		log.Warn("no upgrade checker; leaving the plugin installed")
		return true
	}
	up, err := c.IsUpgrade(ctx)
	if err != nil {
		log.Warn("cannot tell whether this is an upgrade; leaving the plugin installed", "err", err)
		return true
	}
	return up
}

// ChartNameLabel and ChartName are the selector label every DaemonSet of
// the chart carries, whatever its name (nameOverride, istioCompat.names):
// what tells a DaemonSet of this chart from any other.
const (
	ChartNameLabel = "app.kubernetes.io/name"
	ChartName      = "ambient-cni"
)

// DaemonSetUpgradeChecker tells an upgrade from an uninstall when the
// agent shuts down. Only proof counts as an uninstall: the agent's
// DaemonSet is gone (NotFound) or being deleted (deletionTimestamp), read
// at shutdown, or it lives but no longer schedules onto this node (its
// nodeSelector, required node affinity or an untolerated taint on the
// node, read at shutdown): no next agent comes to this node, and a plugin
// left chained would keep every new pod from starting; or, when that read
// fails, the release's signal was seen deleted. Anything else, including
// 401/403 (RBAC can be briefly wrong, or removed before the pods stop),
// leaves the plugin installed: pods then wait for the next agent rather
// than start uncaptured.
//
// The release's signal is a Service of the release (ReleaseSignalWatch)
// that never changes until the uninstall deletes it, watched by name.
// helm's uninstall deletes Services before DaemonSets and RBAC (its
// pre-delete hook deletes it first too), and so does `kubectl delete -f`
// of the plain manifest before the DaemonSet, so the watch has seen it go
// by the time the pods get SIGTERM, even when the RBAC is already gone;
// the agent marks the node as being uninstalled then (OnChange). Its name
// comes from the release's name alone, never from the DaemonSet's, so an
// upgrade that renames the DaemonSet leaves it in place. The agent does
// not watch its DaemonSet: each status write the DaemonSet controller
// makes (about one per node in a rollout) would reach every agent, events
// quadratic in the nodes; the signal carries two events in its life,
// whatever the cluster's size. A DaemonSet deleted alone (the signal
// left in place) is read at shutdown, while the agent keeps its RBAC.
//
// An upgrade that renames the DaemonSet (istioCompat.names, nameOverride)
// creates the new one, then deletes the old one, its RBAC first: the
// agent's own DaemonSet goes, yet another agent takes the node over. So
// the agent's own DaemonSet going is an uninstall only when no other
// DaemonSet of this chart (ChartNameLabel, any name), present and not
// being deleted, schedules onto this node, read at shutdown; when that
// read fails, only a signal seen deleted proves an uninstall.
type DaemonSetUpgradeChecker struct {
	client          UpgradeClient
	namespace, name string
	signal          string
	nodeName        string
	log             *slog.Logger

	mu       sync.Mutex
	seen     watchState
	onChange func(prev, next string)
}

// watchState is what the watch saw of the release's signal, latest first.
type watchState string

const (
	seenNothing  watchState = ""
	seenAlive    watchState = "present"
	seenDeleting watchState = "being deleted"
	seenGone     watchState = "deleted"
)

// UpgradeClient is what the upgrade check reads: the agent's DaemonSet,
// its node, and the release's signal.
type UpgradeClient interface {
	kubeclient.DaemonSetReader
	kubeclient.ServiceMetadataReader
	GetNode(ctx context.Context, name string) (*corev1.Node, error)
}

// NewDaemonSetUpgradeChecker returns a checker for the DaemonSet
// namespace/name of the agent on node nodeName, with the release's signal
// Service signal in namespace (empty: none; the read at shutdown alone
// decides); Run its watch for the agent's lifetime.
func NewDaemonSetUpgradeChecker(client UpgradeClient, namespace, name, signal, nodeName string, log *slog.Logger) *DaemonSetUpgradeChecker {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &DaemonSetUpgradeChecker{client: client, namespace: namespace, name: name, signal: signal, nodeName: nodeName,
		log: log.With("component", "release-signal-watch", "daemonset", namespace+"/"+name, "signal", signal)}
}

// OnChange has f told, from the watch, each change of what it saw of the
// release's signal (the values Seen reports): the agent marks the node as
// being uninstalled the moment the signal is deleted, before any pod gets
// SIGTERM. Call it before Run.
func (d *DaemonSetUpgradeChecker) OnChange(f func(prev, next string)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.onChange = f
}

// othersSelector selects the chart's DaemonSets but the agent's own.
func (d *DaemonSetUpgradeChecker) othersSelector(o *metav1.ListOptions) {
	o.LabelSelector = labels.SelectorFromSet(labels.Set{ChartNameLabel: ChartName}).String()
	o.FieldSelector = fields.OneTermNotEqualSelector("metadata.name", d.name).String()
}

// Run watches, until ctx ends, the metadata of the release's signal (list
// and watch by name: kubeclient.ReleaseSignalWatch). With no signal it
// only waits for ctx.
func (d *DaemonSetUpgradeChecker) Run(ctx context.Context) error {
	if d.signal == "" {
		d.log.Info("no release signal configured: the read of the DaemonSet at shutdown alone tells an uninstall")
		<-ctx.Done()
		return nil
	}
	w := kubeclient.ReleaseSignalWatch(d.client, d.namespace, d.signal)
	inf := cache.NewSharedIndexInformerWithOptions(w.ListerWatcher, w.ExpectedType, cache.SharedIndexInformerOptions{})
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { d.observe(o, false) },
		UpdateFunc: func(_, o any) { d.observe(o, false) },
		DeleteFunc: func(o any) { d.observe(o, true) },
	})
	if err != nil {
		return fmt.Errorf("watch the release signal: %w", err)
	}
	inf.RunWithContext(ctx)
	return nil
}

// stateOf is what an event says of the signal.
func stateOf(o any, deleted bool) (metav1.Object, watchState) {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o, deleted = t.Obj, true
	}
	m, ok := o.(metav1.Object)
	if !ok {
		return nil, seenNothing
	}
	switch {
	case deleted:
		return m, seenGone
	case m.GetDeletionTimestamp() != nil:
		return m, seenDeleting
	}
	return m, seenAlive
}

func (d *DaemonSetUpgradeChecker) observe(o any, deleted bool) {
	m, next := stateOf(o, deleted)
	if m == nil || m.GetName() != d.signal {
		return
	}
	d.mu.Lock()
	prev := d.seen
	d.seen = next
	notify := d.onChange
	d.mu.Unlock()
	if next == prev {
		return
	}
	if next == seenDeleting || next == seenGone {
		d.log.Info("release signal " + string(next) + ": an uninstall; this agent uninstalls the plugin when it stops, unless its DaemonSet, read then, lives and schedules here")
	}
	if notify != nil {
		notify(string(prev), string(next))
	}
}

// Seen reports what the watch last saw of the release's signal: ""
// (nothing yet, or no signal), "present", "being deleted" or "deleted".
func (d *DaemonSetUpgradeChecker) Seen() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return string(d.seen)
}

// signalGone reports whether the watch saw the signal being deleted or
// deleted: proof of an uninstall.
func (d *DaemonSetUpgradeChecker) signalGone() (watchState, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.seen, d.seen == seenDeleting || d.seen == seenGone
}

// IsUpgrade implements UpgradeChecker: false only on proof of
// an uninstall; an error (the caller keeps the plugin) says why it cannot
// tell.
func (d *DaemonSetUpgradeChecker) IsUpgrade(ctx context.Context) (bool, error) {
	up, err := d.ownIsUpgrade(ctx)
	if up || err != nil {
		return up, err
	}
	return d.replaced(ctx)
}

// ownIsUpgrade is the decision by the agent's own DaemonSet.
func (d *DaemonSetUpgradeChecker) ownIsUpgrade(ctx context.Context) (bool, error) {
	ds, err := d.client.GetDaemonSet(ctx, d.namespace, d.name)
	switch {
	case err == nil && ds.DeletionTimestamp != nil:
		return false, nil
	case err == nil:
		return d.targetsThisNode(ctx, ds)
	case apierrors.IsNotFound(err):
		return false, nil
	}
	seen, gone := d.signalGone()
	if gone {
		d.log.Info("cannot read the agent DaemonSet at shutdown, but the release signal was seen "+string(seen)+": uninstall", "err", err)
		return false, nil
	}
	why := "not proof of an uninstall"
	if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) {
		why = "lost rights are not proof of an uninstall (RBAC may be briefly wrong, or removed before the pods stop)"
	}
	last := "the release signal was never seen"
	switch {
	case d.signal == "":
		last = "no release signal is configured"
	case seen != seenNothing:
		last = "the release signal was last seen " + string(seen)
	}
	return false, fmt.Errorf("get daemonset %s/%s: %w; %s, and %s", d.namespace, d.name, err, why, last)
}

// targetsThisNode is the decision for a live DaemonSet: an upgrade when it
// still schedules onto this node. The Node read failing (no rights yet, a
// node object being re-registered) is not proof that it does not.
func (d *DaemonSetUpgradeChecker) targetsThisNode(ctx context.Context, ds *appsv1.DaemonSet) (bool, error) {
	if d.nodeName == "" {
		return true, nil
	}
	node, err := d.client.GetNode(ctx, d.nodeName)
	if err != nil {
		return false, fmt.Errorf("daemonset %s/%s lives; get node %s to tell whether it still schedules here: %w; not proof of an uninstall", d.namespace, d.name, d.nodeName, err)
	}
	targets, why, err := dsplacement.TargetsNode(ds, node)
	if err != nil {
		return false, fmt.Errorf("%w; not proof of an uninstall", err)
	}
	if !targets {
		d.log.Info("agent DaemonSet no longer schedules onto this node ("+why+"): no agent follows, this agent uninstalls the plugin", "node", d.nodeName)
		return false, nil
	}
	return true, nil
}

// replaced tells, once the agent's own DaemonSet is out, whether another
// DaemonSet of this chart still schedules onto this node (a rename): then
// its agent takes the node over and this is an upgrade. The read failing
// (a rename deletes the old release's RBAC before its DaemonSet) is proof
// of nothing unless the release signal was seen deleted: a rename leaves
// it in place.
func (d *DaemonSetUpgradeChecker) replaced(ctx context.Context) (bool, error) {
	var opts metav1.ListOptions
	d.othersSelector(&opts)
	list, err := d.client.ListDaemonSets(ctx, d.namespace, opts)
	if err != nil {
		if seen, gone := d.signalGone(); gone {
			d.log.Info("cannot list the DaemonSets of this chart, but the release signal was seen "+string(seen)+": uninstall", "err", err)
			return false, nil
		}
		return false, fmt.Errorf("agent DaemonSet %s/%s out; list the other DaemonSets of this chart to tell a rename: %w; not proof of an uninstall", d.namespace, d.name, err)
	}
	var node *corev1.Node
	for i := range list.Items {
		ds := &list.Items[i]
		if ds.Name == d.name || ds.DeletionTimestamp != nil {
			continue
		}
		if d.nodeName == "" {
			d.log.Info("agent DaemonSet out, DaemonSet " + ds.Name + " of this chart present: an upgrade that renames it; the pods keep their rules")
			return true, nil
		}
		if node == nil {
			if node, err = d.client.GetNode(ctx, d.nodeName); err != nil {
				return false, fmt.Errorf("daemonset %s/%s of this chart lives; get node %s to tell whether it schedules here: %w; not proof of an uninstall", d.namespace, ds.Name, d.nodeName, err)
			}
		}
		targets, why, err := dsplacement.TargetsNode(ds, node)
		if err != nil {
			return false, fmt.Errorf("%w; not proof of an uninstall", err)
		}
		if targets {
			d.log.Info("agent DaemonSet out, DaemonSet "+ds.Name+" of this chart schedules onto this node: an upgrade that renames it; its agent takes the node over, the pods keep their rules", "node", d.nodeName)
			return true, nil
		}
		d.log.Info("DaemonSet "+ds.Name+" of this chart does not schedule onto this node ("+why+")", "node", d.nodeName)
	}
	return false, nil
}
