package kubeadapter

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
type DaemonSetUpgradeChecker struct {
	client          UpgradeClient
	namespace, name string
	nodeName        string
	log             *slog.Logger

	mu       sync.Mutex
	seen     watchState
	onChange func(prev, next string)
}

// watchState is what the watch saw of the DaemonSet, latest first.
type watchState string

const (
	seenNothing  watchState = ""
	seenAlive    watchState = "present"
	seenDeleting watchState = "being deleted"
	seenGone     watchState = "deleted"
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
		log: log.With("component", "daemonset-watch", "daemonset", namespace+"/"+name)}
}

// OnChange has f told, from the watch, each change of what it saw (the
// values Seen reports): the agent marks the node as being uninstalled the
// moment its DaemonSet is being deleted, before any pod gets SIGTERM.
// Call it before Run.
func (d *DaemonSetUpgradeChecker) OnChange(f func(prev, next string)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.onChange = f
}

// Run watches the DaemonSet's metadata (list and watch by name, all the
// agent's RBAC grants) until ctx ends. Metadata is all the watch looks
// for (a deletion), and each status write of the DaemonSet reaches every
// agent: the whole object would be about twelve times the bytes.
func (d *DaemonSetUpgradeChecker) Run(ctx context.Context) error {
	inf := cache.NewSharedIndexInformerWithOptions(
		kubeclient.DaemonSetMetadataListWatch(d.client, d.namespace, func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("metadata.name", d.name).String()
		}),
		&metav1.PartialObjectMetadata{}, cache.SharedIndexInformerOptions{})
	_, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { d.observe(o, false) },
		UpdateFunc: func(_, o any) { d.observe(o, false) },
		DeleteFunc: func(o any) { d.observe(o, true) },
	})
	if err != nil {
		return fmt.Errorf("watch daemonset: %w", err)
	}
	inf.RunWithContext(ctx)
	return nil
}

func (d *DaemonSetUpgradeChecker) observe(o any, deleted bool) {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o, deleted = t.Obj, true
	}
	ds, ok := o.(metav1.Object)
	if !ok || ds.GetName() != d.name {
		return
	}
	next := seenAlive
	switch {
	case deleted:
		next = seenGone
	case ds.GetDeletionTimestamp() != nil:
		next = seenDeleting
	}
	d.mu.Lock()
	prev := d.seen
	d.seen = next
	notify := d.onChange
	d.mu.Unlock()
	if next != prev && next != seenAlive {
		d.log.Info("agent DaemonSet " + string(next) + ": this agent uninstalls the plugin when it stops")
	}
	if next != prev && notify != nil {
		notify(string(prev), string(next))
	}
}

// Seen reports what the watch last saw of the DaemonSet: "" (nothing yet),
// "present", "being deleted" or "deleted".
func (d *DaemonSetUpgradeChecker) Seen() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return string(d.seen)
}

// IsUpgrade implements UpgradeChecker: false only on proof of
// an uninstall; an error (the caller keeps the plugin) says why it cannot
// tell.
func (d *DaemonSetUpgradeChecker) IsUpgrade(ctx context.Context) (bool, error) {
	ds, err := d.client.GetDaemonSet(ctx, d.namespace, d.name)
	switch {
	case err == nil && ds.DeletionTimestamp != nil:
		return false, nil
	case err == nil:
		return d.targetsThisNode(ctx, ds)
	case apierrors.IsNotFound(err):
		return false, nil
	}
	seen := watchState(d.Seen())
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
