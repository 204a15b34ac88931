package realnode

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/health"
	"github.com/ambient-cni/ambient-cni/test/lib/ztunnel"
)

// Release is the helm release name of the agent.
const Release = "ambient-cni"

// ChartDir is the chart, relative to the repository root.
const ChartDir = "deploy/charts/ambient-cni"

// AgentSocketDir and ZtunnelSocketDir are the node's host directories of
// the agent's and ztunnel's sockets.
func (n *Node) AgentSocketDir() string   { return filepath.Join(n.Dir, "run", "ambient-cni") }
func (n *Node) ZtunnelSocketDir() string { return filepath.Join(n.Dir, "run", "ztunnel") }

// Layout is the agent's run directory on the host: its plugin socket and
// the node files (snapshot, heartbeat, spools) named after it.
func (n *Node) Layout() nodefiles.Layout {
	return nodefiles.InDir(n.AgentSocketDir()).WithStateDir(n.AgentStateDir())
}

// AgentStateDir is the node's persistent agent directory (the chart's
// agent.stateDir), in the node's directory: the machine's is not ours.
func (n *Node) AgentStateDir() string { return filepath.Join(n.Dir, "state", "ambient-cni") }

// AgentSocket is the agent's plugin socket on the host.
func (n *Node) AgentSocket() string { return n.Layout().AgentSocket() }

// ChartValues are the values this node installs the chart with: only what
// a user of such a node sets, each for the reason given. Everything else
// is the chart's default (test/deploy pins those).
func (n *Node) ChartValues(tag string) map[string]any {
	v := map[string]any{
		// The image pushed to the node's registry as tag, pulled by
		// digest; a tag never pushed by its name, which the registry
		// lacks (AgentImage).
		"image": n.imageValues(tag),
		"cni": map[string]any{
			// The node's runtime reads its CNI config and plugins here.
			"binDir":  n.CNIBinDir,
			"confDir": n.CNIConfDir,
			// containerd mounts pod netns under its state dir
			// (netns_mounts_under_state_dir).
			"netnsDirs": []string{n.NetnsDir},
		},
		// Host directories of the node, not the machine's (which other
		// programs on a shared machine may use).
		"agent":   map[string]any{"socketDir": n.AgentSocketDir(), "stateDir": n.AgentStateDir()},
		"ztunnel": map[string]any{"socketDir": n.ZtunnelSocketDir()},
		// No kube-proxy: the kubernetes Service IP would leave the
		// machine. The agent uses the API server on loopback instead.
		"apiServer": map[string]any{"host": "127.0.0.1", "port": n.APIPort},
	}
	if p := n.opts.Layout.Platform(); p != "" {
		// The platform's profile sets everything else it needs; the dirs
		// above stay, each the profile's path under HostRoot, since the
		// machine's real paths are not the node's to write.
		v["platform"] = p
	}
	if n.opts.StartupTaint {
		// A node registered with the startup taint needs an agent that
		// removes it.
		v["startupTaint"] = map[string]any{"enabled": true}
	}
	return v
}

// Helm runs the helm binary against the node, with its caches in the node
// directory.
func (n *Node) Helm(ctx context.Context, args ...string) (string, error) {
	h := filepath.Join(n.Dir, "helm")
	cmd := exec.CommandContext(ctx, n.Tools.Helm, args...)
	cmd.Dir = n.Tools.Repo
	cmd.Env = append(os.Environ(),
		"KUBECONFIG="+n.Kubeconfig,
		"HELM_CACHE_HOME="+filepath.Join(h, "cache"),
		"HELM_CONFIG_HOME="+filepath.Join(h, "config"),
		"HELM_DATA_HOME="+filepath.Join(h, "data"),
	)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("helm %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// writeValues writes values as a YAML file in the node directory.
func (n *Node) writeValues(name string, values map[string]any) (string, error) {
	b, err := yaml.Marshal(values)
	if err != nil {
		return "", err
	}
	p := filepath.Join(n.Dir, name)
	return p, os.WriteFile(p, b, 0o644)
}

// InstallAgent installs the chart as a user does (helm install, waiting
// for the DaemonSet to be ready) with ChartValues(tag) and extra values.
func (n *Node) InstallAgent(ctx context.Context, verb, tag string, extra ...string) error {
	if err := n.applyChart(ctx, verb, tag, []string{"--wait", "--timeout", "5m"}, extra); err != nil {
		return err
	}
	return n.waitRollout(ctx)
}

// waitRollout waits as kubectl rollout status does: the DaemonSet
// controller has seen the new spec, and every node the DaemonSet wants
// runs an updated, available pod. helm --wait alone lets a one-node
// DaemonSet with maxUnavailable 1 pass as soon as its pod is scheduled,
// while its image may still be pulling.
func (n *Node) waitRollout(ctx context.Context) error {
	return n.poll(ctx, "agent DaemonSet rolled out", 5*time.Minute, func(ctx context.Context) (bool, error) {
		l, err := n.Client.AppsV1().DaemonSets(ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ambient-cni"})
		if err != nil {
			return false, err
		}
		if len(l.Items) != 1 {
			return false, fmt.Errorf("%d agent DaemonSets", len(l.Items))
		}
		ds := l.Items[0]
		st := ds.Status
		if st.ObservedGeneration < ds.Generation || st.UpdatedNumberScheduled < st.DesiredNumberScheduled || st.NumberAvailable < st.DesiredNumberScheduled {
			return false, fmt.Errorf("DaemonSet %s: generation %d (observed %d), desired %d, updated %d, available %d%s",
				ds.Name, ds.Generation, st.ObservedGeneration, st.DesiredNumberScheduled, st.UpdatedNumberScheduled, st.NumberAvailable,
				n.agentPodsWhy(ctx))
		}
		return true, nil
	})
}

// agentPodsWhy says, for a rollout that does not finish, what each agent
// pod is waiting for and the latest warning events about it: the reason is
// otherwise only in kubelet's log, gone with the node.
func (n *Node) agentPodsWhy(ctx context.Context) string {
	pods, err := n.AgentPods(ctx)
	if err != nil {
		return "; agent pods: " + err.Error()
	}
	var b strings.Builder
	for i := range pods {
		p := &pods[i]
		fmt.Fprintf(&b, "; pod %s: %s", p.Name, podSummary(p))
		evs, err := n.PodEvents(ctx, p.Namespace, p.Name)
		if err != nil {
			continue
		}
		var warnings []string
		for _, ev := range evs {
			if ev.Type == corev1.EventTypeWarning {
				warnings = append(warnings, ev.Reason+": "+ev.Message)
			}
		}
		if len(warnings) > 3 {
			warnings = warnings[len(warnings)-3:]
		}
		if len(warnings) > 0 {
			fmt.Fprintf(&b, " (events: %s)", strings.Join(warnings, " | "))
		}
	}
	return b.String()
}

// UpgradeAgentNoWait runs helm upgrade with ChartValues(tag) and extra
// values without waiting for the DaemonSet: for settings under which the
// agent never becomes ready (the caller waits for what it expects).
func (n *Node) UpgradeAgentNoWait(ctx context.Context, tag string, extra ...string) error {
	return n.applyChart(ctx, "upgrade", tag, nil, extra)
}

// imageValues are the chart's image values for tag: the registry's
// repository and the digest pushed as tag (or the tag itself when none
// was), pulled when the node lacks it.
func (n *Node) imageValues(tag string) map[string]any {
	v := map[string]any{"repository": n.AgentRepository(), "pullPolicy": "IfNotPresent"}
	if d := n.AgentDigest(tag); d != "" {
		v["digest"] = d
	} else {
		v["tag"] = tag
	}
	return v
}

// applyChart installs or upgrades the release from the chart in the
// node's registry, as docs/release.md says to: verified first
// (VerifyRelease), then helm install oci://…@digest with the image by the
// digest verified. A tag never pushed (a test of an image the node cannot
// pull) has no image to verify: the chart is verified with the release's
// first image (ImageTag), and the image left to fail its pull.
func (n *Node) applyChart(ctx context.Context, verb, tag string, wait, extra []string) error {
	chart, err := n.verifiedChart(ctx, tag)
	if err != nil {
		return err
	}
	vf, err := n.writeValues("values-"+tag+".yaml", n.ChartValues(tag))
	if err != nil {
		return err
	}
	args := append([]string{verb, Release, chart, "--plain-http", "--namespace", ReleaseNamespace, "-f", vf}, wait...)
	_, err = n.Helm(ctx, append(args, extra...)...)
	return err
}

// verifiedChart verifies the release under tag (under ImageTag for a tag
// never pushed) and returns the chart's reference by digest; it fails if
// the registry serves another image under tag than the node pushed.
func (n *Node) verifiedChart(ctx context.Context, tag string) (string, error) {
	verifyTag := tag
	if n.AgentDigest(tag) == "" {
		verifyTag = ImageTag
	}
	v, err := n.VerifyRelease(ctx, verifyTag)
	if err != nil {
		return "", fmt.Errorf("not installed: %w", err)
	}
	if d := n.AgentDigest(verifyTag); v.Image != d {
		return "", fmt.Errorf("not installed: the registry serves %s under %s, the node pushed %s", v.Image, verifyTag, d)
	}
	n.logf("   verified the image %s (signature, SBOM, provenance) and the chart %s", v.Image, v.Chart)
	return v.Chart, nil
}

// UninstallAgent runs helm uninstall and waits until the agent pods are
// gone.
func (n *Node) UninstallAgent(ctx context.Context) error {
	if _, err := n.Helm(ctx, "uninstall", Release, "--namespace", ReleaseNamespace, "--wait", "--timeout", "5m"); err != nil {
		return err
	}
	return n.poll(ctx, "agent pods gone", n.opts.Wait, func(ctx context.Context) (bool, error) {
		pods, err := n.AgentPods(ctx)
		return err == nil && len(pods) == 0, err
	})
}

// AgentPods lists the agent's DaemonSet pods.
func (n *Node) AgentPods(ctx context.Context) ([]corev1.Pod, error) {
	l, err := n.Client.CoreV1().Pods(ReleaseNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=ambient-cni"})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}

// AgentLogTail returns the last lines of every agent pod's log, through
// the API server as kubectl logs reads them, for a failure's report.
func (n *Node) AgentLogTail(ctx context.Context, lines int64) string {
	pods, err := n.AgentPods(ctx)
	if err != nil {
		return fmt.Sprintf("(agent pods: %v)", err)
	}
	var b strings.Builder
	for _, p := range pods {
		out, err := n.Client.CoreV1().Pods(p.Namespace).GetLogs(p.Name, &corev1.PodLogOptions{TailLines: &lines}).DoRaw(ctx)
		fmt.Fprintf(&b, "== %s/%s, last %d lines", p.Namespace, p.Name, lines)
		if err != nil {
			fmt.Fprintf(&b, ": %v\n", err)
			continue
		}
		fmt.Fprintf(&b, ":\n%s\n", out)
	}
	return b.String()
}

// AgentMetricsPort is the chart's default metrics port (host network).
// Health has no port: the chart's exec probes ask the debug socket, as
// AgentGet does.
const AgentMetricsPort = health.DefaultMetricsPort

// AgentDebugSocket is the agent's root-only debug socket on the host (the
// chart's agent.socketDir is a hostPath).
func (n *Node) AgentDebugSocket() string {
	return n.Layout().DebugSocket()
}

// AgentGet GETs a path of the agent where the chart serves it: /metrics
// on the metrics port, the rest (/debug/*, /readyz, /livez, /healthz) on
// the debug socket, where kubelet's exec probes ask.
func (n *Node) AgentGet(ctx context.Context, path string) ([]byte, error) {
	if path == "/metrics" {
		return httpGet(ctx, fmt.Sprintf("http://127.0.0.1:%d%s", AgentMetricsPort, path))
	}
	c := &http.Client{Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", n.AgentDebugSocket())
		},
	}}
	return httpGetWith(ctx, c, "http://agent"+path)
}

// AgentPod is one entry of the agent's /debug/pods.
type AgentPod struct {
	UID, Namespace, Name, State string
	IPs                         []string
}

// AgentState returns the pods the agent has enrolled.
func (n *Node) AgentState(ctx context.Context) ([]AgentPod, error) {
	b, err := n.AgentGet(ctx, "/debug/pods")
	if err != nil {
		return nil, err
	}
	var pods []AgentPod
	if err := json.Unmarshal(b, &pods); err != nil {
		return nil, fmt.Errorf("decode /debug/pods: %w: %s", err, b)
	}
	return pods, nil
}

func httpGet(ctx context.Context, url string) ([]byte, error) {
	return httpGetWith(ctx, noKeepAlive, url)
}

func httpGetWith(ctx context.Context, c *http.Client, url string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 16<<20))
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return b, fmt.Errorf("GET %s: %s: %s", url, resp.Status, bytes.TrimSpace(b))
	}
	return b, nil
}

// noKeepAlive makes one connection per request, so each request the tests
// make is one connection the stand-in can account for.
var noKeepAlive = &http.Client{Transport: &http.Transport{DisableKeepAlives: true, Proxy: nil}}

// StandInName is the ztunnel stand-in pod's name.
const StandInName = "ztunnel"

// StartStandIn runs the ztunnel stand-in as a pod with the host paths
// ztunnel uses (/var/run/ztunnel, from the chart's ztunnel.socketDir) in
// the host network, and waits until it is ready.
func (n *Node) StartStandIn(ctx context.Context) error {
	ports, err := freePorts(1)
	if err != nil {
		return err
	}
	n.standInPort = ports[0]
	return n.startStandInPod(ctx, StandInName, n.Name, "127.0.0.1", n.standInPort)
}

// startStandInPod creates a stand-in pod bound to node, its debug endpoint
// on host:port in the node's network, and waits until it is ready.
func (n *Node) startStandInPod(ctx context.Context, name, node, host string, port int) error {
	hostPathType := corev1.HostPathDirectoryOrCreate
	f := false
	root := int64(0)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ReleaseNamespace, Labels: map[string]string{"app": "ztunnel"}},
		Spec: corev1.PodSpec{
			NodeName:                     node,
			HostNetwork:                  true,
			AutomountServiceAccountToken: &f,
			EnableServiceLinks:           &f,
			Containers: []corev1.Container{{
				Name:            "istio-proxy",
				Image:           n.Images.StandIn,
				ImagePullPolicy: corev1.PullNever,
				Args:            []string{"-socket", "/var/run/ztunnel/ztunnel.sock", "-debug-addr", net.JoinHostPort(host, strconv.Itoa(port))},
				SecurityContext: &corev1.SecurityContext{
					RunAsUser: &root,
					// Like ztunnel: enter pod netns (SYS_ADMIN), mark its
					// sockets and bind there (NET_ADMIN, NET_RAW).
					Capabilities: &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}, Add: []corev1.Capability{"NET_ADMIN", "SYS_ADMIN", "NET_RAW"}},
				},
				VolumeMounts: []corev1.VolumeMount{{Name: "cni-ztunnel-sock-dir", MountPath: "/var/run/ztunnel"}},
				// ztunnel's chart requests these. Without a request the pod
				// is BestEffort (cpu.shares 2): beside a busy agent on a
				// loaded machine it went unscheduled for seconds, past the
				// agent's 5 s ack deadline and every proxied connection's.
				Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
					corev1.ResourceCPU:    resource.MustParse("200m"),
					corev1.ResourceMemory: resource.MustParse("512Mi"),
				}},
				ReadinessProbe: &corev1.Probe{
					ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Host: host, Path: "/workloads", Port: intstr.FromInt(port)}},
					PeriodSeconds: 1,
				},
			}},
			Volumes: []corev1.Volume{{Name: "cni-ztunnel-sock-dir", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: n.ZtunnelSocketDir(), Type: &hostPathType}}}},
		},
	}
	if _, err := n.Client.CoreV1().Pods(ReleaseNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("create ztunnel stand-in pod %s: %w", name, err)
	}
	_, err := n.WaitPodReady(ctx, ReleaseNamespace, name)
	return err
}

// StandInPort is the stand-in's debug port on 127.0.0.1.
func (n *Node) StandInPort() int { return n.standInPort }

func standInGet[T any](ctx context.Context, n *Node, path string) (T, error) {
	return standInGetAt[T](ctx, fmt.Sprintf("127.0.0.1:%d", n.standInPort), path)
}

// standInGetAt GETs a stand-in's debug path at addr and decodes it.
func standInGetAt[T any](ctx context.Context, addr, path string) (T, error) {
	var v T
	b, err := httpGet(ctx, "http://"+addr+path)
	if err != nil {
		return v, err
	}
	err = json.Unmarshal(b, &v)
	return v, err
}

// StandInRecords returns every connection the stand-in proxied.
func (n *Node) StandInRecords(ctx context.Context) ([]ztunnel.Record, error) {
	return standInGet[[]ztunnel.Record](ctx, n, "/records")
}

// StandInOf says, for each failed loop request in d, what the stand-in
// recorded of its connection (found by its source address), and ends with
// the stand-in's log lines about connections it did not proxy: a failure
// report tells a connection that never reached the stand-in from one it
// could not forward and from one whose upstream ended it.
func (n *Node) StandInOf(ctx context.Context, d TrafficCounts) string {
	recs, err := n.StandInRecords(ctx)
	if err != nil {
		return fmt.Sprintf("(stand-in records: %v)", err)
	}
	var b strings.Builder
	for _, f := range d.Failures {
		i := strings.Index(f, " from ")
		if i < 0 {
			continue
		}
		src, _, _ := strings.Cut(f[i+len(" from "):], " ")
		found := false
		for _, r := range recs {
			if r.Source.String() == src {
				fmt.Fprintf(&b, "stand-in record of %s: pod %s port %d to %s via %s tunneled=%v err=%q\n", src, r.UID, r.Port, r.OrigDst, r.Upstream, r.Tunneled, r.Err)
				found = true
			}
		}
		if !found {
			fmt.Fprintf(&b, "the stand-in has no record of %s: it never accepted that connection\n", src)
		}
	}
	lines := int64(400)
	out, err := n.Client.CoreV1().Pods(ReleaseNamespace).GetLogs(StandInName, &corev1.PodLogOptions{TailLines: &lines}).DoRaw(ctx)
	if err != nil {
		fmt.Fprintf(&b, "(stand-in log: %v)\n", err)
		return b.String()
	}
	const most = 40
	shown, left := 0, 0
	for l := range strings.SplitSeq(string(out), "\n") {
		if !strings.Contains(l, "did not proxy") && !strings.Contains(l, "level=WARN") && !strings.Contains(l, "level=ERROR") {
			continue
		}
		// Stalls are the cause the rest follows from: always shown.
		if shown >= most && !strings.Contains(l, "stalled") {
			left++
			continue
		}
		fmt.Fprintf(&b, "stand-in: %s\n", l)
		shown++
	}
	if left > 0 {
		fmt.Fprintf(&b, "stand-in: ... and %d more such lines\n", left)
	}
	b.WriteString(n.Restarts(ctx))
	return b.String()
}

// Restarts lists the node's containers that have restarted, with why the
// last run ended: a liveness restart of an app breaks its connections.
func (n *Node) Restarts(ctx context.Context) string {
	pods, err := n.Client.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + n.Name})
	if err != nil {
		return fmt.Sprintf("(restarts: %v)\n", err)
	}
	var b strings.Builder
	for _, p := range pods.Items {
		for _, cs := range p.Status.ContainerStatuses {
			if cs.RestartCount == 0 {
				continue
			}
			fmt.Fprintf(&b, "restarted: %s/%s container %s %d times", p.Namespace, p.Name, cs.Name, cs.RestartCount)
			if term := cs.LastTerminationState.Terminated; term != nil {
				fmt.Fprintf(&b, ", last ended %s: %s exit %d", term.FinishedAt.UTC().Format("15:04:05"), term.Reason, term.ExitCode)
			}
			b.WriteString("\n")
		}
	}
	return b.String()
}

// StandInWorkloads returns the pods the stand-in serves.
func (n *Node) StandInWorkloads(ctx context.Context) ([]ztunnel.Workload, error) {
	return standInGet[[]ztunnel.Workload](ctx, n, "/workloads")
}

// StandInMessages returns the ZDS requests the stand-in received.
func (n *Node) StandInMessages(ctx context.Context) ([]ztunnel.Message, error) {
	return standInGet[[]ztunnel.Message](ctx, n, "/messages")
}

// AppPort is the test app's port.
const AppPort = 8080

// AppOptions shape an app pod.
type AppOptions struct {
	Labels map[string]string
	// Hello is a URL the app GETs once at start.
	Hello string
	// TermGet is a URL the app GETs after SIGTERM (after TermDelay).
	TermGet   string
	TermDelay time.Duration
	// PreStopGet is a URL a preStop exec hook GETs (after PreStopWait).
	PreStopGet  string
	PreStopWait time.Duration
	// Grace is terminationGracePeriodSeconds (nil: Kubernetes' 30).
	Grace *int64
	// Args replace the app's arguments; with RestartNever the pod runs
	// once (phase Succeeded when the app exits 0).
	Args         []string
	RestartNever bool
}

// AppPod returns an app pod bound to the node: no API access, no Service
// links, readiness and liveness probes on the app.
func (n *Node) AppPod(namespace, name string, o AppOptions) *corev1.Pod {
	f := false
	args := o.Args
	if args == nil {
		args = []string{"serve"}
		if o.Hello != "" {
			args = append(args, "-hello", o.Hello)
		}
		if o.TermGet != "" {
			args = append(args, "-term-get", o.TermGet, "-term-delay", o.TermDelay.String())
		}
	}
	c := corev1.Container{
		Name:            "app",
		Image:           n.Images.App,
		ImagePullPolicy: corev1.PullNever,
		Args:            args,
		Env:             []corev1.EnvVar{{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}}},
		Ports:           []corev1.ContainerPort{{Name: "http", ContainerPort: AppPort}},
		// A small request makes the pod Burstable: a BestEffort pod
		// (cpu.shares 2) starved for seconds on a loaded machine, long
		// enough for its liveness probe to restart it under the traffic
		// the tests count.
		Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("20m")}},
	}
	if !o.RestartNever {
		c.ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/ready", Port: intstr.FromInt(AppPort)}}, PeriodSeconds: 2}
		// Liveness tolerates a stall of about 15 s; restarting the app
		// breaks the held connections the tests count.
		c.LivenessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/live", Port: intstr.FromInt(AppPort)}}, PeriodSeconds: 2, TimeoutSeconds: 3, FailureThreshold: 6}
	}
	if o.PreStopGet != "" {
		c.Lifecycle = &corev1.Lifecycle{PreStop: &corev1.LifecycleHandler{Exec: &corev1.ExecAction{
			Command: []string{"/app", "get", "-wait", o.PreStopWait.String(), o.PreStopGet},
		}}}
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace, Labels: o.Labels},
		Spec: corev1.PodSpec{
			NodeName:                      n.Name,
			AutomountServiceAccountToken:  &f,
			EnableServiceLinks:            &f,
			TerminationGracePeriodSeconds: o.Grace,
			Containers:                    []corev1.Container{c},
		},
	}
	if o.RestartNever {
		pod.Spec.RestartPolicy = corev1.RestartPolicyNever
	}
	return pod
}

// CreateNamespace creates a namespace with labels and waits for its
// default ServiceAccount (the controller manager makes it).
func (n *Node) CreateNamespace(ctx context.Context, name string, labels map[string]string) error {
	if _, err := n.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	return n.poll(ctx, "default ServiceAccount of "+name, n.opts.Wait, func(ctx context.Context) (bool, error) {
		_, err := n.Client.CoreV1().ServiceAccounts(name).Get(ctx, "default", metav1.GetOptions{})
		return err == nil, nil
	})
}

// WaitPodReady waits until a pod is Running and Ready.
func (n *Node) WaitPodReady(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	var pod *corev1.Pod
	err := n.poll(ctx, "pod "+namespace+"/"+name+" ready", n.opts.Wait, func(ctx context.Context) (bool, error) {
		p, err := n.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
			return false, fmt.Errorf("pod %s/%s is %s", namespace, name, p.Status.Phase)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
				return true, nil
			}
		}
		return false, fmt.Errorf("pod %s/%s not ready: %s", namespace, name, podSummary(p))
	})
	return pod, err
}

// WaitPodPhase waits until a pod reaches phase.
func (n *Node) WaitPodPhase(ctx context.Context, namespace, name string, phase corev1.PodPhase) (*corev1.Pod, error) {
	var pod *corev1.Pod
	err := n.poll(ctx, "pod "+namespace+"/"+name+" "+string(phase), n.opts.Wait, func(ctx context.Context) (bool, error) {
		p, err := n.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		pod = p
		if p.Status.Phase != phase {
			return false, fmt.Errorf("pod %s/%s: %s", namespace, name, podSummary(p))
		}
		return true, nil
	})
	return pod, err
}

// PodEvents returns the Events about a pod (kubelet's, the agent's).
func (n *Node) PodEvents(ctx context.Context, namespace, name string) ([]corev1.Event, error) {
	l, err := n.Client.CoreV1().Events(namespace).List(ctx, metav1.ListOptions{
		FieldSelector: "involvedObject.kind=Pod,involvedObject.name=" + name,
	})
	if err != nil {
		return nil, fmt.Errorf("events of pod %s/%s: %w", namespace, name, err)
	}
	return l.Items, nil
}

// WaitPodGone waits until a pod no longer exists in the API.
func (n *Node) WaitPodGone(ctx context.Context, namespace, name string) error {
	return n.poll(ctx, "pod "+namespace+"/"+name+" gone", n.opts.Wait, func(ctx context.Context) (bool, error) {
		_, err := n.Client.CoreV1().Pods(namespace).Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, err
	})
}

// Poll waits for cond with the node's generous deadline.
func (n *Node) Poll(ctx context.Context, what string, cond func(context.Context) (bool, error)) error {
	return n.poll(ctx, what, n.opts.Wait, cond)
}

// podSummary says why a pod is not there yet (waiting reasons, events are
// in kubelet's log).
func podSummary(p *corev1.Pod) string {
	parts := []string{string(p.Status.Phase)}
	for _, cs := range p.Status.ContainerStatuses {
		if w := cs.State.Waiting; w != nil {
			parts = append(parts, cs.Name+": "+w.Reason+" "+w.Message)
		}
		if t := cs.State.Terminated; t != nil {
			parts = append(parts, fmt.Sprintf("%s: terminated %s (%d)", cs.Name, t.Reason, t.ExitCode))
		}
	}
	for _, c := range p.Status.Conditions {
		if c.Status != corev1.ConditionTrue && c.Message != "" {
			parts = append(parts, string(c.Type)+": "+c.Message)
		}
	}
	return strings.Join(parts, "; ")
}

// SandboxID returns the id of a pod's ready sandbox in containerd.
func (n *Node) SandboxID(ctx context.Context, namespace, name string) (string, error) {
	return sandboxID(ctx, n.crictl, namespace, name)
}

// sandboxID is SandboxID through a node's crictl.
func sandboxID(ctx context.Context, crictl func(context.Context, ...string) (string, error), namespace, name string) (string, error) {
	out, err := crictl(ctx, "pods", "--namespace", namespace, "--name", "^"+name+"$", "--state", "ready", "-q")
	if err != nil {
		return "", err
	}
	ids := strings.Fields(out)
	if len(ids) != 1 {
		return "", fmt.Errorf("pod %s/%s: %d ready sandboxes (%v)", namespace, name, len(ids), ids)
	}
	return ids[0], nil
}

// PodNetns returns the netns file of a pod's ready sandbox.
func (n *Node) PodNetns(ctx context.Context, namespace, name string) (string, error) {
	id, err := n.SandboxID(ctx, namespace, name)
	if err != nil {
		return "", err
	}
	out, err := n.crictl(ctx, "inspectp", "-o", "json", id)
	if err != nil {
		return "", err
	}
	var info struct {
		Info struct {
			RuntimeSpec struct {
				Linux struct {
					Namespaces []struct{ Type, Path string }
				}
			}
		}
	}
	if err := json.Unmarshal([]byte(out), &info); err != nil {
		return "", fmt.Errorf("inspectp %s: %w", id, err)
	}
	for _, ns := range info.Info.RuntimeSpec.Linux.Namespaces {
		if ns.Type == "network" && ns.Path != "" {
			return ns.Path, nil
		}
	}
	return "", fmt.Errorf("sandbox %s has no network namespace path", id)
}

// NetnsRules returns every netfilter rule inside a network namespace:
// iptables-save of both flavours and the nftables tables that iptables-nft
// does not manage. Those it manages are in iptables-nft-save's output
// already; nft renders their xtables targets only for the first family it
// prints ("XT target REDIRECT not found" for the other), so listed by nft
// they would read differently with the order in which the families'
// tables were made.
func NetnsRules(ctx context.Context, netnsPath string) (string, error) {
	run := func(c ...string) ([]byte, error) {
		out, err := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + netnsPath}, c...)...).CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("%s in %s: %w: %s", strings.Join(c, " "), netnsPath, err, out)
		}
		return out, nil
	}
	var b strings.Builder
	for _, c := range [][]string{{"iptables-nft-save"}, {"iptables-legacy-save"}, {"ip6tables-nft-save"}, {"ip6tables-legacy-save"}} {
		if _, err := exec.LookPath(c[0]); err != nil {
			continue
		}
		out, err := run(c...)
		if err != nil {
			return "", err
		}
		b.Write(out)
	}
	if _, err := exec.LookPath("nft"); err != nil {
		return b.String(), nil
	}
	tables, err := run("nft", "list", "tables")
	if err != nil {
		return "", err
	}
	for line := range strings.SplitSeq(string(tables), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 || f[0] != "table" {
			continue
		}
		out, err := run("nft", "list", "table", f[1], f[2])
		if err != nil {
			return "", err
		}
		if bytes.Contains(out, []byte("managed by iptables-nft")) {
			continue
		}
		b.Write(out)
	}
	return b.String(), nil
}

// HasCaptureRules reports whether a rule dump holds ambient capture rules
// (the chains are named like Istio's; an nftables backend names its table
// after Istio too).
func HasCaptureRules(rules string) bool {
	return strings.Contains(strings.ToLower(rules), "istio")
}

// PodRules returns the netfilter rules inside a running pod.
func (n *Node) PodRules(ctx context.Context, namespace, name string) (string, error) {
	p, err := n.PodNetns(ctx, namespace, name)
	if err != nil {
		return "", err
	}
	return NetnsRules(ctx, p)
}
