package plugin

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/containernetworking/cni/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
)

// About is printed by the plugin when run without CNI_COMMAND.
const About = "ambient-cni: chained CNI plugin that hands Kubernetes pods to the ambient node agent"

// Plugin implements the CNI verbs. Stdout receives results; Stderr the log.
type Plugin struct {
	Stdout io.Writer
	Stderr io.Writer
}

// New returns a plugin writing results to stdout and logs to stderr.
func New(stdout, stderr io.Writer) *Plugin {
	return &Plugin{Stdout: stdout, Stderr: stderr}
}

// call is the per-invocation context shared by the verbs.
type call struct {
	cfg    *Config
	log    *slog.Logger
	client *ambient.Client
	ctx    context.Context
	cancel context.CancelFunc
	// logged holds a copy of what the call logged, for the agent's log.
	logged *logRecorder
}

// pluginLogTimeout bounds the send of a call's log records to the agent:
// after the verb's work, best effort, and only when something was logged.
const pluginLogTimeout = 250 * time.Millisecond

// finish ends the call: it sends what the call logged, and the error it
// returns to the runtime (which the runtime logs in its own journal), to
// the agent, so the agent's log shows the plugin's side of a failure.
// Nothing is sent on the quiet path (nothing logged at the configured
// level, no error), and a failed send changes nothing.
func (c *call) finish(err error) {
	defer c.cancel()
	if err != nil {
		c.logged.add(slog.LevelError, "CNI call failed", []string{"err", err.Error()})
	}
	if len(c.logged.recs) == 0 {
		return
	}
	recs := c.logged.recs
	// JSON escaping can grow the text past the agent's request limit:
	// send fewer records rather than none.
	for len(recs) > 1 {
		if b, err := json.Marshal(ambient.PluginLog{Records: recs}); err == nil && len(b) <= ambient.MaxRequestBytes {
			break
		}
		recs = recs[:len(recs)/2]
	}
	ctx, cancel := context.WithTimeout(context.Background(), pluginLogTimeout)
	defer cancel()
	_ = c.client.PluginLog(ctx, &ambient.PluginLog{Records: recs})
}

func (p *Plugin) start(verb string, args *CmdArgs) (*call, error) {
	var cfg *Config
	var err error
	if args.conf != nil {
		cfg, err = configFrom(args.conf)
	} else {
		cfg, err = ParseConfig(args.StdinData)
	}
	if err != nil {
		return nil, err
	}
	logged := &logRecorder{}
	log := slog.New(&teeHandler{h: &lazyHandler{h: slog.NewTextHandler(p.Stderr, &slog.HandlerOptions{Level: cfg.LogLevel})}, rec: logged}).
		With("plugin", "ambient-cni", "cmd", verb)
	if args.ContainerID != "" {
		log = log.With("sandbox", args.ContainerID)
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.Timeout)
	return &call{cfg: cfg, log: log, client: &ambient.Client{Socket: cfg.AgentSocket}, ctx: ctx, cancel: cancel, logged: logged}, nil
}

// Add tells the agent about a new pod and waits for its verdict; the pod
// starts (prevResult is printed) only once the agent has enrolled it or
// declared it out of scope. When the agent cannot answer (unreachable,
// past the plugin's deadline, or a broken answer), the plugin decides
// without it (withoutAgent).
func (p *Plugin) Add(args *CmdArgs) (err error) {
	c, err := p.start("ADD", args)
	if err != nil {
		return err
	}
	defer func() { c.finish(err) }()
	if c.cfg.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig,
			"ambient-cni got no prevResult: it must be chained after the primary CNI plugin in a .conflist", "")
	}
	ev, excluded, err := c.podEvent(ambient.CommandAdd, args)
	if err != nil {
		return err
	}
	ns, name := ev.PodNamespace, ev.PodName
	log := c.log.With("pod", ns+"/"+name)
	if excluded {
		log.Debug("namespace excluded by plugin config; passing through")
		return p.passThrough(c.cfg)
	}
	resp, early, err := p.askAgent(c, log, ev)
	switch {
	case early != "":
		return p.passEarly(c, log, ev, early)
	case err != nil:
		return p.fallback(c, log, ev, err)
	case resp.Error != "":
		return agentError("ADD", resp)
	}
	switch resp.Verdict {
	case ambient.VerdictEnrolled, ambient.VerdictNotEnrolled:
		log.Info("agent verdict", "verdict", resp.Verdict)
		return p.passThrough(c.cfg)
	default:
		return types.NewError(types.ErrInternal, fmt.Sprintf("ambient-cni: unexpected agent verdict %q for ADD", resp.Verdict), "")
	}
}

// slowAgent is how long ADD waits for the agent before it also asks the
// API server: a pod that must not be captured then starts without waiting
// out the whole timeout on a hung agent (one that must be captured keeps
// waiting for the agent). Half the timeout when that is shorter.
const slowAgent = 5 * time.Second

// askAgent sends the ADD to the agent. If the agent has not answered
// within slowAgent, it asks the API server too: when that shows the pod
// outside the mesh, early says why and the agent's answer is not awaited.
// When the API server cannot be asked either, a pod of a control-plane
// namespace the snapshot tier (fromSnapshot) would start starts then too. Under
// agentUnreachable fail-closed it only waits for the agent.
func (p *Plugin) askAgent(c *call, log *slog.Logger, ev *ambient.PodEvent) (resp *ambient.PodEventResponse, early string, err error) {
	type answer struct {
		resp *ambient.PodEventResponse
		err  error
	}
	// Buffered: the sender never blocks, and ends with c.ctx.
	done := make(chan answer, 1)
	go func() {
		r, err := c.client.PodEvent(c.ctx, ev)
		done <- answer{r, err}
	}()
	if c.cfg.AgentUnreachable == ambient.AgentUnreachableFailClosed {
		// Strict: a slow agent may still answer, and nothing else decides.
		a := <-done
		return a.resp, "", a.err
	}
	slow := min(slowAgent, c.cfg.Timeout/2)
	t := time.NewTimer(slow)
	defer t.Stop()
	select {
	case a := <-done:
		return a.resp, "", a.err
	case <-t.C:
	}
	if v, err := p.askAPIServer(c, ev, false); err == nil && !v.Enroll {
		return nil, fmt.Sprintf("the node agent has not answered in %s and the API server shows the pod outside the mesh (%s)", slow, v.Reason), nil
	} else if err != nil {
		// The snapshot tier would start a control-plane pod once the
		// timeout is out; the control plane must not wait on a hung agent.
		if d := fromSnapshot(c, ev, err); d.pass && c.cfg.controlPlane(ev.PodNamespace) {
			return nil, fmt.Sprintf("the node agent has not answered in %s and %s", slow, d.why), nil
		}
		log.Debug("agent slow and API server not asked", "err", err)
	}
	a := <-done
	return a.resp, "", a.err
}

// passEarly lets a pod the API server or, for the control plane, the
// snapshot shows outside the mesh start while the agent is slow to
// answer, recorded for the agent to re-check.
func (p *Plugin) passEarly(c *call, log *slog.Logger, ev *ambient.PodEvent, why string) error {
	rec := *ev
	rec.Command = ambient.CommandAdd
	if err := nodefiles.Spool(c.cfg.AddSpoolDir, rec); err != nil {
		log.Error("could not record the pod for the agent to re-check", "err", err, "dir", c.cfg.AddSpoolDir)
	}
	log.Warn("passing through (recorded for the agent to re-check)", "reason", why)
	return p.passThrough(c.cfg)
}

// fallback is ADD while the agent cannot answer: a pod that must not be
// captured starts, recorded in the ADD spool so the agent re-checks it
// first thing when it returns; any other fails with code 11 (the runtime
// retries) until the agent answers.
func (p *Plugin) fallback(c *call, log *slog.Logger, ev *ambient.PodEvent, cause error) error {
	d := p.withoutAgent(c, ev)
	switch {
	case !d.pass && d.agentGone != "":
		// Said first: the runtime's event may cut a long message short.
		log.Error("node agent cannot answer and none will return; failing closed", "err", cause, "reason", d.why)
		return tryAgain("ambient-cni: %s. The pod is not started: it must be captured (%s) and waits for a node agent (%v). "+
			"Put the node back in the DaemonSet's scope (its agent returns and captures the pod), or take the node out of the mesh: "+
			"as root on the node create %s (pods then start, uncaptured), then remove the ambient-cni entry from the node's CNI config list",
			d.agentGone, d.reason, cause, c.cfg.files().Uninstalling())
	case !d.pass:
		log.Warn("node agent cannot answer; failing closed", "err", cause, "reason", d.why)
		return tryAgain("ambient-cni: %v; %s, so the pod is not started until the node agent answers. The runtime will retry: check that the ambient-cni node agent is running on this node", cause, d.why)
	}
	if d.toIstio {
		log.Warn("node agent cannot answer; passing through to istio-cni", "err", cause, "reason", d.why)
		return p.passThrough(c.cfg)
	}
	rec := *ev
	rec.Command = ambient.CommandAdd
	if err := nodefiles.Spool(c.cfg.AddSpoolDir, rec); err != nil {
		// The agent's pod controller still looks at every pod of the node
		// when it returns; the spool only puts these first.
		log.Error("could not record the pod for the agent to re-check", "err", err, "dir", c.cfg.AddSpoolDir)
	}
	log.Warn("node agent cannot answer; passing through (recorded for the agent to re-check)", "err", cause, "reason", d.why)
	return p.passThrough(c.cfg)
}

// decision is withoutAgent's answer.
type decision struct {
	// pass: the pod may start uncaptured.
	pass bool
	// why is the whole reason, for the log and CHECK.
	why string
	// agentGone, for a pod that must be captured, says why no agent will
	// return to the node; reason is then the enablement reason.
	agentGone, reason string
	// toIstio: istio-cni holds the node; its plugin, chained after ours,
	// decides the pod (nothing is recorded for our agent).
	toIstio bool
}

// istioCNIDial bounds the look at istio-cni's socket: a local socket
// answers in microseconds, and a pod waits on it only while no agent of
// ours answers.
const istioCNIDial = 200 * time.Millisecond

// istioCNIAnswers says why istio-cni holds the node when its node agent
// answers on its plugin event socket in runDir ("" when runDir is empty
// or nothing answers there). With ours unable to answer, that is a node
// given back to istio-cni while ours is broken (crashing, its image not
// pullable): istio-cni's installer chains its plugin after ours, and that
// plugin captures the pod as before the switch, so ours lets it through
// rather than holding every ambient pod for an agent that may not come.
// A connection opened and closed is nothing to istio-cni's server (it
// serves HTTP on that socket).
func istioCNIAnswers(runDir string) string {
	if runDir == "" {
		return ""
	}
	sock := filepath.Join(runDir, ambient.IstioCNIEventSocket)
	conn, err := net.DialTimeout("unix", sock, istioCNIDial)
	if err != nil {
		return ""
	}
	_ = conn.Close()
	return "istio-cni's node agent answers on " + sock + ": the node is istio-cni's again, and its plugin, chained after this one, decides the pod"
}

// withoutAgent decides a pod while the agent cannot answer, in tiers:
//  1. an uninstall in progress (its marker in the state directory): every
//     pod passes, the mesh is leaving the node;
//  2. agentUnreachable fail-closed: every pod fails closed;
//  3. istio-cni's node agent answering on the node (istioCNIRunDir set by
//     a takeover) and its plugin in the network's chain for a while
//     (istioCNIChained): every pod passes to istio-cni's plugin;
//  4. the API server, asked with the plugin's own credential by the
//     fallback binary: the agent's own decision, from live labels;
//  5. failing that, the persistent snapshot: only the control plane's
//     namespaces and the excluded ones pass, unless the snapshot shows the
//     pod captured or its namespace enabled; every other pod waits.
//
// It returns whether the pod may start uncaptured, and why.
//
// A pod the API server shows must be captured waits even when the
// fallback finds that no agent will return (the agent's DaemonSet deleted
// or no longer running on the node): starting it uncaptured would break
// the one promise that matters, and istio-cni's plugin also fails such a
// pod while its agent is gone. The wait is then explained, with what ends
// it, instead of pointing at an agent that is not coming.
func (p *Plugin) withoutAgent(c *call, ev *ambient.PodEvent) decision {
	pass := func(why string) decision { return decision{pass: true, why: why} }
	wait := func(why string) decision { return decision{why: why} }
	if _, err := os.Lstat(c.cfg.files().Uninstalling()); err == nil {
		return pass("the mesh is being removed from this node (uninstall marker " + c.cfg.files().Uninstalling() + ")")
	}
	if c.cfg.AgentUnreachable == ambient.AgentUnreachableFailClosed {
		return wait(fmt.Sprintf("agentUnreachable is %q", ambient.AgentUnreachableFailClosed))
	}
	notYet := ""
	if why := istioCNIAnswers(c.cfg.IstioCNIRunDir); why != "" {
		chained, how := istioCNIChained(c.cfg.IstioCNIConfDir, c.cfg.Name, time.Now())
		if chained {
			return decision{pass: true, toIstio: true, why: why + "; " + how}
		}
		// Its agent answers before its installer chains its plugin: the
		// pod is decided as if istio-cni were not there, and one that
		// must be captured waits for istio-cni's plugin.
		notYet = "; istio-cni's node agent answers, but " + how
	}
	d := p.byAPIServer(c, ev)
	if !d.pass {
		d.why += notYet
	}
	return d
}

// byAPIServer is withoutAgent's tiers 4 and 5.
func (p *Plugin) byAPIServer(c *call, ev *ambient.PodEvent) decision {
	pass := func(why string) decision { return decision{pass: true, why: why} }
	wait := func(why string) decision { return decision{why: why} }
	v, apiErr := p.askAPIServer(c, ev, true)
	if apiErr == nil {
		if v.Enroll {
			d := wait(fmt.Sprintf("the API server shows the pod must be captured (%s)", v.Reason))
			if v.AgentGone != "" {
				d.why += "; " + v.AgentGone + ", so no node agent will return to this node"
				d.agentGone, d.reason = v.AgentGone, v.Reason
			}
			return d
		}
		return pass(fmt.Sprintf("the API server shows the pod outside the mesh (%s)", v.Reason))
	}
	return fromSnapshot(c, ev, apiErr)
}

// fromSnapshot is withoutAgent's last tier, for a pod the API server
// cannot be asked about (apiErr says why). The snapshot is as old as the
// agent's absence: a label put on the pod or its namespace since is not
// in it. So it may make a pod wait (captured then, or its namespace
// enabled then) but never vouches that a pod may start uncaptured; only
// the control plane's namespaces and the excluded ones start on its word.
func fromSnapshot(c *call, ev *ambient.PodEvent, apiErr error) decision {
	ns := ev.PodNamespace
	pass := func(why string) decision { return decision{pass: true, why: why} }
	wait := func(why string) decision { return decision{why: why} }
	snap, serr := nodefiles.ReadSnapshot(c.cfg.files().StateSnapshot())
	switch {
	case snap != nil && ev.PodUID != "" && snap.Pods[ev.PodUID]:
		return wait(fmt.Sprintf("the API server cannot be asked (%v) and the agent's snapshot shows the pod captured", apiErr))
	case snap != nil && slices.Contains(snap.EnabledNamespaces, ns):
		return wait(fmt.Sprintf("the API server cannot be asked (%v) and namespace %q is enabled per the agent's snapshot", apiErr, ns))
	case c.cfg.controlPlane(ns):
		return pass(fmt.Sprintf("the API server cannot be asked (%v); namespace %q is the control plane's and not enabled per the agent's snapshot", apiErr, ns))
	case snap == nil:
		return wait(fmt.Sprintf("the API server cannot be asked (%v) and there is no usable snapshot (%v), so the pod may need ambient capture", apiErr, serr))
	case slices.Contains(snap.ExcludedNamespaces, ns):
		return pass(fmt.Sprintf("the API server cannot be asked (%v); namespace %q is excluded", apiErr, ns))
	}
	return wait(fmt.Sprintf("the API server cannot be asked (%v) and the pod's and its namespace's labels are unknown (the agent's snapshot may predate a label)", apiErr))
}

// passThrough prints prevResult in the config's version.
func (p *Plugin) passThrough(cfg *Config) error {
	if _, err := p.Stdout.Write(cfg.PrevResult.out); err != nil {
		return types.NewError(types.ErrIOFailure, "write the result: "+err.Error(), "")
	}
	return nil
}

// Del tells the agent a sandbox is gone. It never fails because the agent
// is unreachable: the request is spooled for the agent to replay.
func (p *Plugin) Del(args *CmdArgs) (err error) {
	c, err := p.start("DEL", args)
	if err != nil {
		return err
	}
	defer func() { c.finish(err) }()
	k8s, err := ParseK8sArgs(args.Args)
	if err != nil {
		// Nothing about the pod is needed to remove a sandbox.
		c.log.Warn("ignoring unparsable CNI_ARGS on DEL", "err", err)
		k8s = &K8sArgs{}
	}
	ev := &ambient.PodEvent{
		Command: ambient.CommandDel, PodName: string(k8s.K8S_POD_NAME), PodNamespace: string(k8s.K8S_POD_NAMESPACE),
		PodUID: string(k8s.K8S_POD_UID), SandboxID: args.ContainerID, Netns: args.Netns, IfName: args.IfName,
	}
	if ev.Validate() != nil {
		// Keep only what identifies the sandbox; the agent needs no more.
		ev = &ambient.PodEvent{Command: ambient.CommandDel, SandboxID: args.ContainerID}
		if err := ev.Validate(); err != nil {
			return types.NewError(types.ErrInvalidEnvironmentVariables, "ambient-cni: invalid sandbox id: "+err.Error(), "")
		}
	}
	resp, err := c.client.PodEvent(c.ctx, ev)
	if err != nil {
		if serr := nodefiles.Spool(c.cfg.SpoolDir, *ev); serr != nil {
			c.log.Error("node agent unreachable and DEL could not be spooled; the agent's GC will clean up", "err", err, "spool_err", serr)
		} else {
			c.log.Warn("node agent unreachable; DEL spooled for the agent", "err", err, "dir", c.cfg.SpoolDir)
		}
		return nil
	}
	if resp.Error != "" {
		return agentError("DEL", resp)
	}
	return nil
}

// Check asks the agent to verify the pod's rules.
func (p *Plugin) Check(args *CmdArgs) (err error) {
	c, err := p.start("CHECK", args)
	if err != nil {
		return err
	}
	defer func() { c.finish(err) }()
	if c.cfg.PrevResult == nil {
		return types.NewError(types.ErrInvalidNetworkConfig, "ambient-cni got no prevResult for CHECK", "")
	}
	ev, excluded, err := c.podEvent(ambient.CommandCheck, args)
	if err != nil || excluded {
		return err
	}
	ns, name := ev.PodNamespace, ev.PodName
	resp, err := c.client.PodEvent(c.ctx, ev)
	switch {
	case err != nil:
		if d := p.withoutAgent(c, ev); !d.pass {
			return tryAgain("ambient-cni: %v; cannot verify pod %s/%s: %s", err, ns, name, d.why)
		}
		return nil
	case resp.Error != "":
		return agentError("CHECK", resp)
	}
	return nil
}

// Status succeeds unless configured to require the agent, because a
// failing STATUS marks the whole node NotReady.
func (p *Plugin) Status(args *CmdArgs) (err error) {
	c, err := p.start("STATUS", args)
	if err != nil {
		return err
	}
	defer func() { c.finish(err) }()
	if !c.cfg.StatusRequiresAgent {
		return nil
	}
	if err := c.client.Status(c.ctx); err != nil {
		return types.NewError(types.ErrPluginNotAvailable,
			fmt.Sprintf("ambient-cni: %v; pods cannot be enrolled until the node agent is back", err), "")
	}
	return nil
}

// GC forwards the runtime's valid attachments so the agent can forget
// sandboxes that no longer exist.
func (p *Plugin) GC(args *CmdArgs) (err error) {
	c, err := p.start("GC", args)
	if err != nil {
		return err
	}
	defer func() { c.finish(err) }()
	if c.cfg.ValidAttachments == nil {
		// No list is not an empty list: forwarding it would make the agent
		// forget every pod on the node.
		c.log.Warn("GC without cni.dev/valid-attachments; nothing to forward")
		return nil
	}
	// The runtime lists the valid attachments of this network only.
	req := &ambient.GCRequest{ValidSandboxIDs: []string{}, Network: c.cfg.Name}
	for _, a := range c.cfg.ValidAttachments {
		if !slices.Contains(req.ValidSandboxIDs, a.ContainerID) {
			req.ValidSandboxIDs = append(req.ValidSandboxIDs, a.ContainerID)
		}
	}
	resp, err := c.client.GC(c.ctx, req)
	if err != nil {
		// The agent garbage-collects on its own when it returns.
		c.log.Warn("GC not forwarded", "err", err)
		return nil
	}
	if resp.Error != "" {
		return agentError("GC", resp)
	}
	return nil
}

// podEvent reads the pod from CNI_ARGS and builds and validates the
// request ADD and CHECK send. excluded reports a pod in a namespace the
// plugin config excludes (the event then holds only its name and
// namespace): the caller lets it through without asking the agent.
func (c *call) podEvent(cmd ambient.Command, args *CmdArgs) (ev *ambient.PodEvent, excluded bool, err error) {
	k8s, err := ParseK8sArgs(args.Args)
	if err != nil {
		return nil, false, err
	}
	if err := k8s.requirePod(); err != nil {
		return nil, false, err
	}
	ev = &ambient.PodEvent{PodName: string(k8s.K8S_POD_NAME), PodNamespace: string(k8s.K8S_POD_NAMESPACE)}
	if slices.Contains(c.cfg.ExcludedNamespaces, ev.PodNamespace) {
		return ev, true, nil
	}
	ips, err := c.cfg.PrevResult.PodIPs()
	if err != nil {
		return nil, false, err
	}
	ev.Command, ev.PodUID, ev.IPs = cmd, string(k8s.K8S_POD_UID), ips
	ev.SandboxID, ev.Netns, ev.IfName, ev.Network = args.ContainerID, args.Netns, args.IfName, c.cfg.Name
	if err := ev.Validate(); err != nil {
		return nil, false, types.NewError(types.ErrInvalidEnvironmentVariables, "ambient-cni: invalid pod data from the runtime: "+err.Error(), "")
	}
	return ev, false, nil
}

func tryAgain(format string, a ...any) error {
	return types.NewError(types.ErrTryAgainLater, fmt.Sprintf(format, a...), "")
}

// agentError turns the agent's failure answer into a CNI error that names
// the side at fault: code 11 when the agent says retrying will help, 4 when
// it rejected the request as invalid (built from the runtime's CNI_NETNS,
// CNI_CONTAINERID and CNI_ARGS), else 999, saying whether a CHECK found a
// mismatch, the agent does not know the request (plugin and agent of
// different versions) or refused it, or failed.
func agentError(verb string, resp *ambient.PodEventResponse) error {
	switch {
	case resp.Retryable:
		return tryAgain("ambient-cni: node agent could not complete %s yet: %s; the runtime will retry", verb, resp.Error)
	case resp.Status == 400 || resp.Status == 413:
		return types.NewError(types.ErrInvalidEnvironmentVariables,
			fmt.Sprintf("ambient-cni: node agent rejected %s as invalid: %s", verb, resp.Error), "the request carries the runtime's CNI_NETNS, CNI_CONTAINERID and CNI_ARGS")
	case resp.Status == 409:
		return types.NewError(types.ErrInternal, fmt.Sprintf("ambient-cni: %s failed: %s", verb, resp.Error), "")
	case resp.Status == 404 || resp.Status == 405:
		return types.NewError(types.ErrInternal,
			fmt.Sprintf("ambient-cni: node agent does not support %s (%s); are the plugin binary and the agent of the same version?", verb, resp.Error), "")
	case resp.Status == 403:
		return types.NewError(types.ErrInternal, fmt.Sprintf("ambient-cni: node agent refused %s: %s", verb, resp.Error), "")
	}
	return types.NewError(types.ErrInternal, fmt.Sprintf("ambient-cni: node agent failed %s: %s", verb, resp.Error), "")
}
