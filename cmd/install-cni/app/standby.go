package app

import (
	"context"
	"errors"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/installer"
)

// The switch from istio-cni, node by node: ambient-cni is installed on
// every node while istio-cni still runs there, and on each node its agent
// stands by (image pulled, options accepted, health served, ready) until
// istio-cni has left that node for good; then it starts as on a node
// istio-cni has left, and takes istio-cni's chain entry and pods over.

// standbyPoll is how often a standing-by agent looks whether istio-cni has
// left: a dial of a local socket, and only once it fails, two API reads.
const standbyPoll = 500 * time.Millisecond

// istioCNIGoneTimeout bounds the API reads of one look.
const istioCNIGoneTimeout = 5 * time.Second

// standbyStep is the start step that waits for istio-cni to leave.
const standbyStep = "istio-cni gone from the node"

// istioCNIGone says istio-cni's node agent has left the node for good:
// nothing answers on its plugin socket (sock) and its DaemonSet no longer
// schedules onto the node (left), so no istio-cni pod comes back to chain
// itself next to ours. Either alone is not enough: the socket is missing
// while istio-cni's pod restarts, and a DaemonSet that moved off the node
// may still have its pod there, terminating.
func istioCNIGone(sock func(string) error, left apicalls.IstioCNILeft) func(string) error {
	return func(runDir string) error {
		if err := sock(runDir); err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(context.Background(), istioCNIGoneTimeout)
		defer cancel()
		return left.Check(ctx)
	}
}

// errIstioCNIReturns ends an agent whose node istio-cni's DaemonSet
// schedules onto again (a rollback of that node): the agent gives the node
// back (giveBackSteps), and its next start stands by.
var errIstioCNIReturns = errors.New("istio-cni's DaemonSet schedules onto this node again: giving the node back")

// withStandby returns the start with the standby step placed after the
// debug socket (kubelet's probes are answered while it waits) and the steps
// that would take from a live istio-cni what it serves moved after it:
// the ZDS socket (ztunnel's one socket, which binding renames over
// istio-cni's) and the host probe SNAT. Once past the standby, the agent
// watches for istio-cni coming back to the node. Without a takeover the
// start is unchanged.
func (a *App) withStandby(cs *components, steps []step) []step {
	if a.cfg.IstioCNIRunDir == "" {
		return steps
	}
	var moved, out []step
	for _, s := range steps {
		if s.name == "ZDS socket" || s.name == "host probe SNAT" {
			moved = append(moved, s)
			continue
		}
		out = append(out, s)
		if s.name == "debug socket" {
			out = append(out, step{name: standbyStep, do: func(ctx context.Context) error {
				if err := a.awaitIstioCNI(ctx); err != nil {
					return err
				}
				cs.run("istio-cni-return", a.watchIstioCNIReturn)
				return nil
			}})
			out = append(out, moved...)
			moved = nil
		}
	}
	return append(out, moved...)
}

// awaitIstioCNI returns once istio-cni holds the node no more: it is not
// chained or its agent has left for good (installer.IstioCNIHolds), and
// its DaemonSet does not schedule onto the node (an istio-cni coming back
// after this agent gave the node back, not chained yet). Meanwhile the
// agent is ready and says why it waits, once, in its log and in an Event
// on its pod.
func (a *App) awaitIstioCNI(ctx context.Context) error {
	said, withdrawn := false, false
	defer a.standby.Store(false)
	for {
		err := a.installer.IstioCNIHolds()
		if err != nil && !withdrawn && installer.IstioCNIAnswers(a.cfg.IstioCNIRunDir) {
			// istio-cni chained and its agent serving: our plugin, left
			// chained by a give-back (or by a broken agent of ours) so
			// that no pod started in a chain without either, goes.
			withdrawn = a.withdraw(ctx)
		}
		if err == nil {
			// Not chained: unless it is on its way. An API that does not
			// answer does not hold the node (after a reboot the node's
			// pods need the agent).
			lctx, cancel := context.WithTimeout(ctx, istioCNIGoneTimeout)
			if back, _ := a.istioLeft.Targets(lctx); back {
				err = errors.New("istio-cni's DaemonSet schedules onto this node")
			}
			cancel()
		}
		if err == nil {
			if said {
				a.log.Info("istio-cni has left the node: taking over")
			}
			return nil
		}
		if !said {
			a.standby.Store(true)
			a.log.Info("standing by: istio-cni holds the node", "why", err)
			a.events.Eventf(a.selfRef(), corev1.EventTypeNormal, "StandingBy", "istio-cni holds the node; taking over once it has left: %v", err)
			said = true
		}
		select {
		case <-ctx.Done():
			return errStopRequested
		case <-time.After(standbyPoll):
		}
	}
}

// withdraw takes what a give-back (or a broken agent of ours) left off a
// node istio-cni holds, saying so when anything of it was there: the
// records of the pods handed over (istio-cni's agent adopted them; an
// uninstall from here must not release them), our host probe SNAT
// (istio-cni's agent has its own) and our plugin. False when it must be
// tried again.
func (a *App) withdraw(ctx context.Context) bool {
	forgot, err := a.agent.ForgetHandedOver()
	if err != nil {
		a.log.Warn("standing by: cannot forget the pods handed over to istio-cni yet", "err", err)
		return false
	}
	if forgot > 0 {
		a.log.Info("standing by: istio-cni's agent answers; the pods handed over to it forgotten", "pods", forgot)
	}
	if err := a.agent.RemoveHostProbe(); err != nil {
		// Harmless if left (it SNATs probes to the address istio-cni's
		// does), and the next takeover or uninstall puts it right: not a
		// reason to keep our plugin in the chain.
		a.log.Warn("standing by: our host probe SNAT left in place", "err", err)
	}
	wctx, cancel := context.WithTimeout(ctx, shutdownTimeout)
	defer cancel()
	took, err := a.installer.Withdraw(wctx)
	if err != nil {
		a.log.Warn("standing by: cannot withdraw our plugin from behind istio-cni yet", "err", err)
		return false
	}
	if took {
		a.log.Info("standing by: istio-cni is chained and its agent answers; our plugin withdrawn")
		a.events.Eventf(a.selfRef(), corev1.EventTypeNormal, "Withdrawn", "istio-cni is chained on the node and its agent answers: our plugin is unchained")
	}
	return true
}

// watchIstioCNIReturn ends with errIstioCNIReturns once a pod of
// istio-cni's DaemonSet, not terminating, is on the node (the pod cache,
// isIstioCNIPod): it is scheduled before it starts, so the agent has
// handed the pods over and left no ztunnel connection behind when
// istio-cni's agent starts.
func (a *App) watchIstioCNIReturn(ctx context.Context) error {
	t := time.NewTicker(standbyPoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if name := a.istioCNIPodHere(); name != "" {
			a.log.Info("istio-cni's pod is scheduled onto the node: giving the node back", "pod", name)
			a.events.Eventf(a.selfRef(), corev1.EventTypeNormal, "GivingBack", "istio-cni's pod %s is scheduled onto the node: handing the pods over to it, captured; our plugin stays chained until istio-cni's is and its agent answers", name)
			return errIstioCNIReturns
		}
	}
}

// istioCNIPodHere names a pod of istio-cni's DaemonSet on the node, not
// terminating, in the pod cache; "" when there is none.
func (a *App) istioCNIPodHere() string {
	pods, err := a.pods.Pods()
	if err != nil {
		return ""
	}
	for _, p := range pods {
		if p.Namespace == a.cfg.PodNamespace && p.DeletionTimestamp == nil && isIstioCNIPod(p, a.cfg.IstioCNIDaemonSet) {
			return p.Name
		}
	}
	return ""
}

// isIstioCNIPod reports whether a pod is one of istio-cni's DaemonSet
// daemonSet, by the labels Istio's chart gives its pods (the pod cache
// keeps labels, not owners): k8s-app is the DaemonSet's name, and
// app.kubernetes.io/name is istio-cni (ours, with istioCompat.names, have
// the same k8s-app).
func isIstioCNIPod(p *corev1.Pod, daemonSet string) bool {
	return p.Labels["k8s-app"] == daemonSet && p.Labels["app.kubernetes.io/name"] == "istio-cni"
}

// selfRef is the agent's own pod, where its Events go.
func (a *App) selfRef() *corev1.ObjectReference {
	return &corev1.ObjectReference{APIVersion: "v1", Kind: "Pod", Namespace: a.cfg.PodNamespace, Name: a.cfg.PodName}
}

// istioCNIConfDir is the plugin entry's istioCNIConfDir: the host's CNI
// config directory, written only with istio-cni's run directory (the
// takeover), where the plugin looks for istio-cni's plugin in the chain.
func istioCNIConfDir(c *Config) string {
	if c.IstioCNIRunDir == "" {
		return ""
	}
	return c.CNIHostConfDir
}
