package kubeadapter

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/tools/cache"

	"github.com/ambient-cni/ambient-cni/pkg/dstarget"
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
// at shutdown or seen earlier by the watch Run keeps on it, or it lives
// but no longer schedules onto this node (its nodeSelector, required node
// affinity or an untolerated taint on the node, read at shutdown): no
// next agent comes to this node, and a plugin left chained would keep
// every new pod from starting. Anything else,
// including 401/403 (RBAC can be briefly wrong, or removed before the pods
// stop), leaves the plugin installed: pods then wait for the next agent
// rather than start uncaptured. helm uninstall deletes the DaemonSet before
// its RBAC, so the watch has seen the deletion by the time the pods get
// SIGTERM, even when the RBAC is already gone.
//
// An upgrade that renames the DaemonSet (istioCompat.names, nameOverride)
// creates the new one, then deletes the old one, its RBAC first: the
// agent's own DaemonSet goes, yet another agent takes the node over. So
// the agent's own DaemonSet going is an uninstall only when no other
// DaemonSet of this chart (ChartNameLabel, any name), present and not
// being deleted, schedules onto this node, read at shutdown; when that
// read fails, one that a second watch saw present is not proof of an
// uninstall.
type DaemonSetUpgradeChecker struct {
	client          UpgradeClient
	namespace, name string
	nodeName        string
	log             *slog.Logger

	mu   sync.Mutex
	seen watchState
	// others is what the second watch saw of the chart's other
	// DaemonSets, by name: present or being deleted.
	others   map[string]watchState
	onChange func(prev, next string)
}

// watchState is what the watch saw of the DaemonSet, latest first.
type watchState string

const (
	seenNothing  watchState = ""
	seenAlive    watchState = "present"
	seenDeleting watchState = "being deleted"
	seenGone     watchState = "deleted"
	// seenReplaced: the agent's DaemonSet is being deleted or gone while
	// another DaemonSet of this chart is present (a rename): not, by
	// itself, an uninstall.
	seenReplaced watchState = "replaced"
)

// UpgradeClient is what the upgrade check reads: the agent's DaemonSet
// and its node.
type UpgradeClient interface {
	kubeclient.DaemonSetReader
	GetNode(ctx context.Context, name string) (*corev1.Node, error)
}

// NewDaemonSetUpgradeChecker returns a checker for the DaemonSet
// namespace/name of the agent on node nodeName; Run its watch for the
// agent's lifetime.
func NewDaemonSetUpgradeChecker(client UpgradeClient, namespace, name, nodeName string, log *slog.Logger) *DaemonSetUpgradeChecker {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &DaemonSetUpgradeChecker{client: client, namespace: namespace, name: name, nodeName: nodeName,
		others: map[string]watchState{},
		log:    log.With("component", "daemonset-watch", "daemonset", namespace+"/"+name)}
}

// OnChange has f told, from the watch, each change of what it saw (the
// values Seen reports): the agent marks the node as being uninstalled the
// moment its DaemonSet is being deleted, before any pod gets SIGTERM, and
// not when it is replaced. Call it before Run.
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

// Run watches, until ctx ends, the metadata of the agent's DaemonSet
// (list and watch by name) and of the chart's other DaemonSets in its
// namespace (by label; none but during a rename). Metadata is all the
// watches look for (a deletion, a DaemonSet present), and each status
// write of the DaemonSet reaches every agent: the whole object would be
// about twelve times the bytes.
func (d *DaemonSetUpgradeChecker) Run(ctx context.Context) error {
	own, err := d.informer(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", d.name).String()
	}, d.observe)
	if err != nil {
		return err
	}
	others, err := d.informer(d.othersSelector, d.observeOther)
	if err != nil {
		return err
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		others.RunWithContext(ctx)
	}()
	own.RunWithContext(ctx)
	<-done
	return nil
}

func (d *DaemonSetUpgradeChecker) informer(tweak func(*metav1.ListOptions), observe func(any, bool)) (cache.SharedIndexInformer, error) {
	inf := cache.NewSharedIndexInformerWithOptions(
		kubeclient.DaemonSetMetadataListWatch(d.client, d.namespace, tweak),
		&metav1.PartialObjectMetadata{}, cache.SharedIndexInformerOptions{})
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { observe(o, false) },
		UpdateFunc: func(_, o any) { observe(o, false) },
		DeleteFunc: func(o any) { observe(o, true) },
	})
	if err != nil {
		return nil, fmt.Errorf("watch daemonsets: %w", err)
	}
	return inf, nil
}

// stateOf is what an event says of a DaemonSet.
func stateOf(o any, deleted bool) (metav1.Object, watchState) {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o, deleted = t.Obj, true
	}
	ds, ok := o.(metav1.Object)
	if !ok {
		return nil, seenNothing
	}
	switch {
	case deleted:
		return ds, seenGone
	case ds.GetDeletionTimestamp() != nil:
		return ds, seenDeleting
	}
	return ds, seenAlive
}

func (d *DaemonSetUpgradeChecker) observe(o any, deleted bool) {
	ds, next := stateOf(o, deleted)
	if ds == nil || ds.GetName() != d.name {
		return
	}
	d.update(func() { d.seen = next })
}

func (d *DaemonSetUpgradeChecker) observeOther(o any, deleted bool) {
	ds, next := stateOf(o, deleted)
	if ds == nil || ds.GetName() == d.name {
		return
	}
	d.update(func() {
		if next == seenGone {
			delete(d.others, ds.GetName())
		} else {
			d.others[ds.GetName()] = next
		}
	})
}

// update applies change under the lock, then logs and reports the change
// of what Seen says, if any.
func (d *DaemonSetUpgradeChecker) update(change func()) {
	d.mu.Lock()
	prev := d.stateLocked()
	change()
	next := d.stateLocked()
	others := d.presentLocked()
	notify := d.onChange
	d.mu.Unlock()
	if next == prev {
		return
	}
	switch next {
	case seenDeleting, seenGone:
		d.log.Info("agent DaemonSet " + string(next) + ": this agent uninstalls the plugin when it stops")
	case seenReplaced:
		d.log.Info("agent DaemonSet being deleted or deleted while another DaemonSet of this chart is present (a rename): "+
			"no uninstall if it schedules onto this node", "others", others)
	}
	if notify != nil {
		notify(string(prev), string(next))
	}
}

// stateLocked is what Seen reports.
func (d *DaemonSetUpgradeChecker) stateLocked() watchState {
	if (d.seen == seenDeleting || d.seen == seenGone) && len(d.presentLocked()) > 0 {
		return seenReplaced
	}
	return d.seen
}

// presentLocked names the chart's other DaemonSets seen present, sorted.
func (d *DaemonSetUpgradeChecker) presentLocked() []string {
	var names []string
	for name, s := range d.others {
		if s == seenAlive {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	return names
}

// Seen reports what the watch last saw of the DaemonSet: "" (nothing yet),
// "present", "being deleted", "deleted", or "replaced" (being deleted or
// deleted while another DaemonSet of this chart is present).
func (d *DaemonSetUpgradeChecker) Seen() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return string(d.stateLocked())
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
	d.mu.Lock()
	seen := d.seen
	d.mu.Unlock()
	if seen == seenDeleting || seen == seenGone {
		d.log.Info("cannot read the agent DaemonSet at shutdown, but it was seen "+string(seen)+": uninstall", "err", err)
		return false, nil
	}
	why := "not proof of an uninstall"
	if apierrors.IsForbidden(err) || apierrors.IsUnauthorized(err) {
		why = "lost rights are not proof of an uninstall (RBAC may be briefly wrong, or removed before the pods stop)"
	}
	last := "it was never seen"
	if seen != seenNothing {
		last = "it was last seen " + string(seen)
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
	targets, why, err := dstarget.TargetsNode(ds, node)
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
// (a rename deletes the old release's RBAC before its DaemonSet) is not
// proof of an uninstall while the watch saw one present: an upgrade.
func (d *DaemonSetUpgradeChecker) replaced(ctx context.Context) (bool, error) {
	var opts metav1.ListOptions
	d.othersSelector(&opts)
	list, err := d.client.ListDaemonSets(ctx, d.namespace, opts)
	if err != nil {
		d.mu.Lock()
		present := d.presentLocked()
		d.mu.Unlock()
		if len(present) > 0 {
			// Not proof of an uninstall: whether they schedule here is
			// unknown, and a rename is what this looks like.
			d.log.Info("agent DaemonSet out while other DaemonSets of this chart were seen present (a rename), which cannot be read now: "+
				"upgrade, the pods keep their rules", "others", present, "err", err)
			return true, nil
		}
		d.log.Info("cannot list the DaemonSets of this chart, and the watch saw none besides the agent's: uninstall", "err", err)
		return false, nil
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
		targets, why, err := dstarget.TargetsNode(ds, node)
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
