package app

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"path"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/enablement"
	"github.com/ambient-cni/ambient-cni/pkg/ambient/nodefiles"
	"github.com/ambient-cni/ambient-cni/pkg/apicalls"
	"github.com/ambient-cni/ambient-cni/pkg/health"
	"github.com/ambient-cni/ambient-cni/pkg/installer"
	"github.com/ambient-cni/ambient-cni/pkg/netns"
	"github.com/ambient-cni/ambient-cni/pkg/nodeagent"
	"github.com/ambient-cni/ambient-cni/pkg/nodetaint"
	"github.com/ambient-cni/ambient-cni/pkg/rulesbackend"
	"github.com/ambient-cni/ambient-cni/pkg/verifier"
)

// EnvPrefix prefixes every flag's environment-variable name.
const EnvPrefix = "AMBIENT_"

// Defaults owned by the process itself; every other default in the table
// below is the owning package's constant.
const (
	// defaultDaemonSet is the chart's DaemonSet name.
	defaultDaemonSet = "ambient-cni"
	// defaultPluginBinary is where the image carries the plugin.
	defaultPluginBinary = "/opt/ambient-cni/bin/ambient-cni"
	// hostRoot is where the DaemonSet mounts the host's CNI directories.
	hostRoot = "/host"
	// defaultProcRoot is the process's own /proc (the chart mounts the
	// host's elsewhere).
	defaultProcRoot = "/proc"
	// defaultLogLevel is install-cni's own log level.
	defaultLogLevel = "info"
	// defaultLogFormat is text, as istio-cni's default (its chart's
	// global.logAsJson is false): kubectl logs is read by people.
	defaultLogFormat = "text"
	// defaultKubeClientQPS and defaultKubeClientBurst are the agent's
	// client-side API rate limit, as Istio's CNI agent's (client-go's own
	// 5/10 capped the agent at 5 pods/s).
	defaultKubeClientQPS   = 80
	defaultKubeClientBurst = 160
)

// The plugin's token lifetime. A year, as istio-cni's plugin token (its
// agent's projected token, which the API server extends to a year): the
// plugin still starts pods by the API server's word after a node was off,
// or its agent could not start, for that long less a day (tokens are
// renewed daily). The token is bound to the node, reads only what the
// plugin's role allows, and a helm uninstall (which deletes the
// ServiceAccount) ends it at once. The maximum stays well under the
// TokenRequest API's 2^32 seconds.
const (
	DefaultPluginTokenLifetime = 365 * 24 * time.Hour
	MaxPluginTokenLifetime     = 2 * DefaultPluginTokenLifetime
)

// Config is the parsed configuration of install-cni.
type Config struct {
	NodeName     string
	PodName      string
	PodNamespace string
	DaemonSet    string
	// ReleaseSignal is the release's signal Service in PodNamespace,
	// whose deletion is an uninstall (apicalls.DaemonSetUpgradeChecker).
	ReleaseSignal string
	Kubeconfig    string
	// KubeClientQPS and KubeClientBurst are the API client's client-side
	// rate limit (client-go's token bucket); KubeClientConfig applies them.
	KubeClientQPS   float32
	KubeClientBurst int
	// AnnotationQPS and AnnotationBurst pace the redirection annotation
	// writes, below the client's limit (nodeagent.Config).
	AnnotationQPS   float32
	AnnotationBurst int

	CNIBinDir string
	// CNIExtraBinDirs are more bin dirs the plugin binary is kept in, for
	// a runtime that searches several (installer.Config.ExtraBinDirs).
	CNIExtraBinDirs []string
	CNIConfDir      string
	// CNIHostConfDir is CNIConfDir as the host names it, for the plugin.
	CNIHostConfDir string
	CNIConfName    string
	// CNIOwnedConfig and CNIOwnedConfName: write a conflist of our own
	// that sorts before the primary's (installer.Config.Owned).
	CNIOwnedConfig   bool
	CNIOwnedConfName string
	// CNIChainInNetworkFolder: our entry in the primary network's folder
	// instead of its file (installer.Config.Sibling).
	CNIChainInNetworkFolder bool
	// IstioCNIRunDir, when set, lets the installer take over from a
	// chained istio-cni whose node agent is gone.
	IstioCNIRunDir string
	// IstioCNIDaemonSet names istio-cni's DaemonSet in the agent's
	// namespace: the takeover waits until it no longer schedules onto
	// the node.
	IstioCNIDaemonSet string
	PluginType        string
	PluginBinary      string
	PluginTimeout     time.Duration
	PluginLogLevel    string
	StatusChecksAgent bool
	AgentUnreachable  string
	AgentDownAfter    time.Duration

	AgentSocket string
	StateDir    string
	ZDSSocket   string
	ProcRoot    string
	NetnsDirs   []string

	ExcludedNamespaces  []string
	DataPlaneNamespaces []string
	EnablementSelectors *enablement.Selectors
	// EnablementSelectorText is the enablement-selector setting as given,
	// for the plugin's credential file (its fallback parses it again).
	EnablementSelectorText string
	// ControlPlaneNamespaces never wait on the agent (Istio's system
	// namespace by default, the platform's system namespaces; "prefix-*"
	// matches by prefix); the agent's own and the data-plane namespaces
	// are added.
	ControlPlaneNamespaces []string
	// PluginServiceAccount is the plugin's own ServiceAccount in the
	// agent's namespace; "" writes no credential.
	PluginServiceAccount string
	// PluginTokenLifetime is how long each of its tokens is valid.
	PluginTokenLifetime time.Duration
	ZtunnelWait         time.Duration
	// VerifyPeriod is how often every captured pod is proven again; 0
	// turns the verifier off.
	VerifyPeriod time.Duration
	DNSCapture   bool
	RulesBackend rulesbackend.Selection
	ProbeSNATv4  netip.Addr
	ProbeSNATv6  netip.Addr
	IPv6         bool
	// AWSBranchENIProbe routes kubelet probes of EKS branch ENI pods
	// through their veth (ruleset.BranchENIRules).
	AWSBranchENIProbe bool

	// StartupTaint removes the node's startup taint once the agent is
	// ready to capture; StartupTaintOnShutdown puts it back when the agent
	// stops and its DaemonSet lives on.
	StartupTaint           bool
	StartupTaintOnShutdown bool

	HealthAddr  string
	MetricsAddr string
	LogLevel    string
	LogFormat   string
}

// SettingsAttr is the effective settings of a Config that Parse made from
// the same args and environment, as one log attribute: "settings", a group
// with one key per setting, in the table's order, each as text (default,
// environment or flag, flags winning; the annotation budget as validate
// left it). No setting holds a secret: the kubeconfig is a path.
func (c *Config) SettingsAttr(args []string, getenv func(string) string) slog.Attr {
	opts := options()
	values := make(map[string]string, len(opts))
	fs := flag.NewFlagSet("install-cni", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	for _, o := range opts {
		v := o.def
		if o.alias() != "" {
			if e := getenv(EnvName(o.alias())); e != "" {
				v = e
			}
		}
		if e := getenv(EnvName(o.name)); e != "" {
			v = e
		}
		values[o.name] = v
		record := func(v string) error { values[o.name] = v; return nil }
		fs.Func(o.name, "", record)
		if o.alias() != "" {
			fs.Func(o.alias(), "", record)
		}
	}
	_ = fs.Parse(args) // Parse accepted these args already
	values["annotation-qps"] = strconv.FormatFloat(float64(c.AnnotationQPS), 'g', -1, 32)
	values["annotation-burst"] = strconv.Itoa(c.AnnotationBurst)
	attrs := make([]any, 0, len(opts))
	for _, o := range opts {
		attrs = append(attrs, slog.String(o.name, values[o.name]))
	}
	return slog.Group("settings", attrs...)
}

// option is one row of the settings table.
type option struct {
	name, help string
	def        string
	set        func(c *Config, v string) error
}

// alias is the older name of a setting ("" for none), still read as flag
// and environment variable so that existing deployments keep working.
func (o option) alias() string {
	if o.name == "rules-backend" {
		return "iptables-backend"
	}
	return ""
}

// defaultSelectorText is Istio's default enablement selector list as the
// setting spells it.
func defaultSelectorText() string {
	b, err := json.Marshal(enablement.DefaultSelectorEntries())
	if err != nil {
		panic(err)
	}
	return string(b)
}

// options is the settings table; its order is the documentation's order.
// Each default names the constant of the package that owns it.
func options() []option {
	return []option{
		{"node-name", "Name of this node (from the downward API); required.", "", str(func(c *Config) *string { return &c.NodeName })},
		{"pod-name", "Name of the agent's own pod, never enrolled.", "", str(func(c *Config) *string { return &c.PodName })},
		{"pod-namespace", "Namespace of the agent's own pod and DaemonSet.", "", str(func(c *Config) *string { return &c.PodNamespace })},
		{"daemonset-name", "The agent's DaemonSet, read by name at shutdown. Shutdown uninstalls the plugin only on proof: the DaemonSet is gone or being deleted, or no longer schedules onto this node (nodeSelector, required node affinity, an untolerated taint), read then; or, when that read fails, release-signal was seen deleted. Otherwise, including 401/403, the plugin stays installed.", defaultDaemonSet, str(func(c *Config) *string { return &c.DaemonSet })},
		{"release-signal", "The release's signal: a Service in pod-namespace that never changes until the uninstall deletes it (before the DaemonSet and the RBAC), watched by name. Seeing it deleted writes the uninstall marker at once, and is the proof of an uninstall when the agent can no longer read its DaemonSet at shutdown. Its name comes from the release's, not the DaemonSet's, so an upgrade that renames the DaemonSet keeps it. Empty: no watch; the read at shutdown alone decides.", "", str(func(c *Config) *string { return &c.ReleaseSignal })},
		{"kubeconfig", "Kubeconfig file; empty means in-cluster configuration.", "", str(func(c *Config) *string { return &c.Kubeconfig })},
		{"kube-client-qps", "Requests per second the agent's Kubernetes client may send on average (client-side limit; ambient ADDs, DELs and enrollments each cost requests). Istio's CNI agent uses 80.", strconv.Itoa(defaultKubeClientQPS), positiveFloat(func(c *Config) *float32 { return &c.KubeClientQPS })},
		{"kube-client-burst", "Requests the agent's Kubernetes client may send at once above kube-client-qps, e.g. when a namespace label enrolls many running pods. Istio's CNI agent uses 160.", strconv.Itoa(defaultKubeClientBurst), positiveInt(func(c *Config) *int { return &c.KubeClientBurst })},
		{"annotation-qps", "Redirection annotation writes per second the agent sends on average; must stay below kube-client-qps, so that a namespace label enrolling many pods never holds up the requests a capture makes. The kubelet's own client limit (docs/install-cni.md says why).", strconv.Itoa(nodeagent.DefaultAnnotationQPS), positiveFloat(func(c *Config) *float32 { return &c.AnnotationQPS })},
		{"annotation-burst", "Redirection annotation writes the agent may send at once above annotation-qps; must stay below kube-client-burst.", strconv.Itoa(nodeagent.DefaultAnnotationBurst), positiveInt(func(c *Config) *int { return &c.AnnotationBurst })},
		{"cni-bin-dir", "Host CNI binary directory, as mounted in the container.", hostRoot + installer.DefaultBinDir, str(func(c *Config) *string { return &c.CNIBinDir })},
		{"cni-extra-bin-dirs", "Comma-separated more host CNI binary directories, as mounted in the container, that the plugin binary is also copied to and kept in, exactly as in cni-bin-dir. For a runtime that searches a list of directories and runs the first binary named as the config's type (containerd 2.x bin_dirs, CRI-O plugin_dirs): list every directory of the runtime's list besides cni-bin-dir, so none holds an older or foreign " + installer.DefaultPluginName + " that shadows ours. Readiness needs every copy; an uninstall removes every copy, an upgrade leaves them. Each absolute, none twice (cni-bin-dir included).", "", dirList(func(c *Config) *[]string { return &c.CNIExtraBinDirs })},
		{"cni-conf-dir", "Host CNI config directory, as mounted in the container.", hostRoot + installer.DefaultConfDir, str(func(c *Config) *string { return &c.CNIConfDir })},
		{"cni-host-conf-dir", "cni-conf-dir as the host names it (the runtime's CNI config directory). With istio-cni-run-dir, the takeover writes it into the plugin's entry: a node given back to istio-cni while our agent cannot answer has its pods passed on to istio-cni's plugin only once that plugin has been in the network's chain there for 5 s (istio-cni's agent answers before its installer chains it). Empty: the plugin never passes a pod on to istio-cni, and a pod that must be captured waits for our agent.", "", str(func(c *Config) *string { return &c.CNIHostConfDir })},
		{"cni-conf-name", "Primary CNI config file to chain into; empty picks the runtime's choice (lexically first valid file).", "", str(func(c *Config) *string { return &c.CNIConfName })},
		{"cni-owned-config", "Write a conflist of the agent's own, named cni-owned-conf-name, holding the primary's plugins and ours, instead of chaining into the primary's file: it sorts first, so the runtime loads it, and a primary that rewrites its own file (its agent does at every start, before ours after a reboot) cannot drop our entry. Kept in step with every write of the primary's file, removed when that file goes and at uninstall; while no agent runs (after a reboot, or an agent gone for good) the runtime runs our copy of the primary's last config. When the name does not sort before the primary's (or cni-conf-name is not the runtime's choice) the agent chains instead. docs/reliability.md weighs the two.", "false", boolean(func(c *Config) *bool { return &c.CNIOwnedConfig })},
		{"cni-chain-in-network-folder", "Put the plugin's entry in the primary network's folder (<cni-conf-dir>/<network name>/zz-<plugin-type>.conf) instead of the primary's conflist: libcni 1.3 and later (containerd 2.1, CRI-O 1.33) runs it after the list's plugins, so a primary that rewrites its own file (its agent does at every start, before ours after a reboot) cannot drop it, and no copy of the primary's config is ours. Only for a runtime that reads the folder: an older one never runs the plugin from there. A primary that cannot carry it there (a single-plugin .conf, loadOnlyInlinedPlugins, istio-cni chained in its file) is chained into as without it; cni-owned-config wins over it.", "false", boolean(func(c *Config) *bool { return &c.CNIChainInNetworkFolder })},
		{"cni-owned-conf-name", "Name of the owned conflist (a .conflist in cni-conf-dir that sorts before the primary's). With cni-owned-config off, a file of that name holding our entry is removed.", installer.DefaultOwnedConfName, str(func(c *Config) *string { return &c.CNIOwnedConfName })},
		{"istio-cni-run-dir", "istio-cni's run directory on the host (its chart's /var/run/istio-cni), as mounted in the container. When set, an istio-cni found chained in the primary config is replaced by our entry in one write once nothing answers on its plugin event socket there and istio-cni's DaemonSet (istio-cni-daemonset) no longer schedules onto this node; until then the agent stands by: it binds no socket, chains nothing and touches no pod. Unset, the agent refuses to chain next to istio-cni.", "", str(func(c *Config) *string { return &c.IstioCNIRunDir })},
		{"istio-cni-daemonset", "istio-cni's DaemonSet, in the agent's namespace, that the takeover (istio-cni-run-dir) waits to see no longer scheduling onto this node: a node label its nodeSelector no longer matches, or the DaemonSet being deleted. Not found, the agent does not take over.", apicalls.IstioCNIDaemonSet, str(func(c *Config) *string { return &c.IstioCNIDaemonSet })},
		{"cni-plugin-type", "Plugin type (and binary name) written into the conflist.", installer.DefaultPluginName, str(func(c *Config) *string { return &c.PluginType })},
		{"plugin-binary", "Plugin binary inside the image, copied into cni-bin-dir and cni-extra-bin-dirs.", defaultPluginBinary, str(func(c *Config) *string { return &c.PluginBinary })},
		{"plugin-timeout", "How long the plugin waits for the agent's answer; must exceed ztunnel-wait.", ambient.DefaultPluginTimeout.String(), duration(func(c *Config) *time.Duration { return &c.PluginTimeout })},
		{"plugin-log-level", "Log level of the plugin on the runtime's log (debug, info, warn, error).", ambient.DefaultPluginLogLevel, str(func(c *Config) *string { return &c.PluginLogLevel })},
		{"plugin-status-checks-agent", "Make CNI STATUS fail (error 50) while the agent is unreachable; off by default because a failing STATUS marks the node NotReady.", "false", boolean(func(c *Config) *bool { return &c.StatusChecksAgent })},
		{"plugin-agent-unreachable", "What the plugin does for a pod outside excluded-namespaces while the agent cannot answer: snapshot (ask the API server with the plugin's own credential and decide as the agent would: a pod that must be captured fails with CNI error 11, any other starts and is re-checked; with the API server down too, decide by the agent's snapshot in state-dir, failing closed for what it cannot vouch for) or fail-closed (every such pod fails with error 11 until the agent answers).", ambient.AgentUnreachableSnapshot, func(c *Config, v string) error {
			switch v {
			case ambient.AgentUnreachableFailClosed, ambient.AgentUnreachableSnapshot:
				c.AgentUnreachable = v
				return nil
			}
			return fmt.Errorf("want %s or %s", ambient.AgentUnreachableFailClosed, ambient.AgentUnreachableSnapshot)
		}},
		{"plugin-agent-down-after", "Accepted for existing configurations; no decision uses it any more.", ambient.DefaultAgentDownAfter.String(), func(c *Config, v string) error {
			d, err := time.ParseDuration(v)
			if err != nil || d <= 0 || d > ambient.MaxAgentDownAfter {
				return fmt.Errorf("want a duration in (0, %s]", ambient.MaxAgentDownAfter)
			}
			c.AgentDownAfter = d
			return nil
		}},
		{"agent-socket", "Unix socket the plugin reaches the agent on (directory 0700, socket 0600).", ambient.DefaultAgentSocket, str(func(c *Config) *string { return &c.AgentSocket })},
		{"state-dir", "Persistent host directory (on disk, not tmpfs; directory 0700): what the plugin decides by when the agent cannot answer, kept across reboots, and the uninstall marker.", ambient.DefaultStateDir, str(func(c *Config) *string { return &c.StateDir })},
		{"zds-socket", "ZDS socket ztunnel connects to.", ambient.DefaultZDSSocket, str(func(c *Config) *string { return &c.ZDSSocket })},
		{"proc-root", "The host's /proc as mounted in the container, scanned to find running pods' network namespaces.", defaultProcRoot, str(func(c *Config) *string { return &c.ProcRoot })},
		{"netns-dirs", "Comma-separated directories where the runtime mounts pod network namespaces; the only netns paths accepted from the plugin besides /proc/<pid>/ns/net.", strings.Join(netns.DefaultRoots, ","), list(func(c *Config) *[]string { return &c.NetnsDirs })},
		{"excluded-namespaces", "Comma-separated namespaces never captured.", ambient.DefaultExcludedNamespace, list(func(c *Config) *[]string { return &c.ExcludedNamespaces })},
		{"data-plane-namespaces", "Comma-separated namespaces where the data-plane labels (app=ztunnel, app.kubernetes.io/name=ztunnel or ambient-cni) keep a pod out of the mesh: the agent's and ztunnel's own. Elsewhere the labels exempt nothing. Empty: the agent's own namespace (pod-namespace).", "", list(func(c *Config) *[]string { return &c.DataPlaneNamespaces })},
		{"enablement-selector", "Which pods are in the mesh, past the exclusions (hostNetwork, sidecar, excluded-namespaces, data-plane pods): Istio's enablement selectors (its chart's ambient.enablementSelectors), a YAML or JSON list of entries with podSelector and namespaceSelector, each a Kubernetes label selector (matchLabels, matchExpressions; empty matches everything). A pod matching any entry (its labels the podSelector, its namespace's the namespaceSelector) is enrolled. The default is Istio's: a pod labelled istio.io/dataplane-mode=ambient, or not labelled none in a namespace labelled ambient. Unknown fields are an error.", defaultSelectorText(), func(c *Config, v string) error {
			s, err := enablement.ParseSelectors([]byte(v))
			if err != nil {
				return err
			}
			c.EnablementSelectors, c.EnablementSelectorText = s, v
			return nil
		}},
		{"control-plane-namespaces", "Comma-separated namespaces that never wait on the agent: Istio's own (istio-system, where istiod, ztunnel and its gateways run whatever namespace the agent is installed in) and the platform's system namespaces (an entry ending in * is a prefix, as openshift-*), besides the agent's own and the data-plane namespaces. While the agent cannot answer, the plugin decides their pods by the API server and, failing that, lets them start unless the agent's snapshot shows their namespace enabled; the agent does the same for a pod it has not seen yet while the API server cannot be asked.", enablement.DefaultDataPlaneNamespace, list(func(c *Config) *[]string { return &c.ControlPlaneNamespaces })},
		{"plugin-service-account", "The plugin's own ServiceAccount in pod-namespace, allowed only to get pods, namespaces, nodes and the agent's DaemonSet: the agent writes a token of it, bound to the node, into state-dir for the plugin to ask the API server while the agent cannot answer. Empty: no credential (the plugin decides by the snapshot alone).", "", str(func(c *Config) *string { return &c.PluginServiceAccount })},
		{"plugin-token-lifetime", "Lifetime asked for each token of plugin-service-account (the API server may shorten it); the agent renews it daily, or after half the lifetime granted if that comes first. It bounds how long the plugin can still ask the API server while no agent runs (a node off, an agent that cannot start): a year by default, as istio-cni's plugin token.", "8760h", func(c *Config, v string) error {
			d, err := time.ParseDuration(v)
			if err != nil || d < 10*time.Minute || d > MaxPluginTokenLifetime {
				return fmt.Errorf("want a duration in [10m, %s]", MaxPluginTokenLifetime)
			}
			c.PluginTokenLifetime = d
			return nil
		}},
		{"ztunnel-wait", "How long CNI ADD waits for a connected ztunnel to acknowledge a pod before failing with a retryable error.", nodeagent.DefaultZtunnelTimeout.String(), duration(func(c *Config) *time.Duration { return &c.ZtunnelWait })},
		{"verify-period", "How often every captured pod is proven still captured (its rules, ztunnel's in-pod listeners, its probe-set entry, its annotation), spread evenly over the period; drift is repaired and reported, and a pod that should be captured and is not is captured. 0 turns the verifier off.", verifier.DefaultPeriod.String(), period(time.Second, func(c *Config) *time.Duration { return &c.VerifyPeriod })},
		{"dns-capture", "Capture DNS (port 53) to ztunnel by default, as Istio's chart does (ambient.dnsCapture); per pod: annotation ambient.istio.io/dns-capture.", "true", boolean(func(c *Config) *bool { return &c.DNSCapture })},
		{"rules-backend", "Rules backend in pods and for the host probe SNAT: auto (native nftables when the kernel supports it, else iptables), nftables, iptables (flavour detected from the node), or iptables in one flavour: nft or legacy. Each backend also removes what the other left.", string(rulesbackend.Auto), func(c *Config, v string) error {
			sel, err := rulesbackend.Parse(v)
			if err != nil {
				return err
			}
			c.RulesBackend = sel
			return nil
		}},
		{"ipv6", "Capture IPv6 too where a pod has it, as Istio's chart does by default (ambient.ipv6); false installs IPv4 redirection only (in pods and for the host probe SNAT), so dual-stack pods' IPv6 goes direct, and removes IPv6 rules an earlier setting left.", "true", boolean(func(c *Config) *bool { return &c.IPv6 })},
		{"enable-aws-branch-eni-probe", "On EKS nodes prepared for security groups for pods (net.ipv4.tcp_early_demux=0), route kubelet probes of captured branch ENI pods through the pod's veth with two ip rules per pod, as Istio's variable of the same name does; without them the probe SNAT source cannot cross the VPC and the probes fail. Inert on other nodes.", "true", boolean(func(c *Config) *bool { return &c.AWSBranchENIProbe })},
		{"probe-snat-ipv4", "Source address kubelet probes are SNATed to (IPv4).", ambient.DefaultProbeSNATv4.String(), addr(func(c *Config) *netip.Addr { return &c.ProbeSNATv4 }, false)},
		{"probe-snat-ipv6", "Source address kubelet probes are SNATed to (IPv6).", ambient.DefaultProbeSNATv6.String(), addr(func(c *Config) *netip.Addr { return &c.ProbeSNATv6 }, true)},
		{"startup-taint", "Remove the startup taint " + nodetaint.Key + ":" + string(nodetaint.Effect) + " (kubelet --register-with-taints) from this node once the agent is ready to capture: the plugin is chained, startup reconcile is done, both sockets listen and a ztunnel acked its snapshot. Needs the chart's nodes patch permission (startupTaint.enabled).", "false", boolean(func(c *Config) *bool { return &c.StartupTaint })},
		{"startup-taint-on-shutdown", "With startup-taint: put the startup taint back when the agent stops and its DaemonSet lives on (an upgrade, a restart, a node drain; never an uninstall), so no pod is scheduled onto the node until the next agent is ready.", "false", boolean(func(c *Config) *bool { return &c.StartupTaintOnShutdown })},
		{"health-addr", "Optional TCP address of /healthz, /livez and /readyz; empty or off serves none. Kubelet needs none: the chart's exec probes (install-cni probe live, install-cni probe ready) ask the same endpoints on the root-only debug socket, because in the host network any port may be taken by another pod (Istio gateways hold 15021). Nothing else is served there.", health.DefaultAddr, func(c *Config, v string) error {
			if v == "off" {
				v = ""
			}
			c.HealthAddr = v
			return nil
		}},
		{"metrics-addr", "Address of /metrics (Prometheus; counts and gauges, no pod names); off turns it off. The default port is clear of Istio's ports. A taken port is an error in the log and a Warning Event on the agent's pod, and is retried every 30 s; the agent serves CNI meanwhile. The debug endpoints, which name pods, are served only on the root-only Unix socket debug.sock next to agent-socket.", health.DefaultMetricsAddr, func(c *Config, v string) error {
			if v == "off" {
				v = ""
			}
			c.MetricsAddr = v
			return nil
		}},
		{"log-level", "Log level (debug, info, warn, error).", defaultLogLevel, func(c *Config, v string) error {
			switch v {
			case "debug", "info", "warn", "error":
				c.LogLevel = v
				return nil
			}
			return fmt.Errorf("want debug, info, warn or error")
		}},
		{"log-format", "Log format: text (key=value lines, for people; istio-cni's default) or json (one object per line, for log pipelines).", defaultLogFormat, func(c *Config, v string) error {
			switch v {
			case "text", "json":
				c.LogFormat = v
				return nil
			}
			return fmt.Errorf("want text or json")
		}},
	}
}

// NewLogHandler is the slog handler of a log format (text or json; see
// the log-format setting) writing to w.
func NewLogHandler(format string, w io.Writer, opts *slog.HandlerOptions) slog.Handler {
	if format == "json" {
		return slog.NewJSONHandler(w, opts)
	}
	return slog.NewTextHandler(w, opts)
}

// envNames names the environment variables that set o, for errors: the
// alias's too when only it is set.
func (o option) envNames(getenv func(string) string) string {
	if o.alias() != "" && getenv(EnvName(o.name)) == "" && getenv(EnvName(o.alias())) != "" {
		return EnvName(o.alias())
	}
	return EnvName(o.name)
}

// EnvName returns the environment variable that sets flag name.
func EnvName(name string) string {
	return EnvPrefix + strings.ToUpper(strings.ReplaceAll(name, "-", "_"))
}

// Parse reads defaults, then environment variables (via getenv), then
// command-line args, and validates the result. Flags win over the
// environment.
func Parse(args []string, getenv func(string) string, stderr io.Writer) (*Config, error) {
	c := &Config{}
	opts := options()
	for _, o := range opts {
		v := o.def
		if o.alias() != "" {
			if e := getenv(EnvName(o.alias())); e != "" {
				v = e
			}
		}
		if e := getenv(EnvName(o.name)); e != "" {
			v = e
		}
		if v == "" {
			continue
		}
		if err := o.set(c, v); err != nil {
			return nil, fmt.Errorf("%s=%q: %w", o.envNames(getenv), v, err)
		}
	}
	fs := flag.NewFlagSet("install-cni", flag.ContinueOnError)
	fs.SetOutput(stderr)
	for _, o := range opts {
		set := func(v string) error { return o.set(c, v) }
		fs.Func(o.name, fmt.Sprintf("%s (env %s, default %q)", o.help, EnvName(o.name), o.def), set)
		if o.alias() != "" {
			fs.Func(o.alias(), fmt.Sprintf("Old name of --%s.", o.name), set)
		}
	}
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	return c, c.validate()
}

// EnablementPolicy is the policy the agent decides with: the excluded
// namespaces, the data-plane namespaces (by default the agent's own), the
// enablement selectors and the agent's own pod.
func (c *Config) EnablementPolicy() enablement.Policy {
	p := enablement.Policy{ExcludedNamespaces: c.ExcludedNamespaces, DataPlaneNamespaces: c.DataPlaneNamespaces, Selectors: c.EnablementSelectors,
		Self: types.NamespacedName{Namespace: c.PodNamespace, Name: c.PodName}}
	if len(p.DataPlaneNamespaces) == 0 && c.PodNamespace != "" {
		p.DataPlaneNamespaces = []string{c.PodNamespace}
	}
	return p
}

// Layout is where the agent's node files live: beside the agent socket,
// and the persistent ones in the state directory; the one place
// install-cni names them, handed to every part as this value.
func (c *Config) Layout() nodefiles.Layout {
	return nodefiles.ForSocket(c.AgentSocket).WithStateDir(c.StateDir)
}

// ControlPlane lists the namespaces that never wait on the agent: the
// agent's own, the data-plane namespaces and control-plane-namespaces.
func (c *Config) ControlPlane() []string {
	out := slices.Clone(c.ControlPlaneNamespaces)
	if c.PodNamespace != "" {
		out = append(out, c.PodNamespace)
	}
	out = append(out, c.EnablementPolicy().DataPlaneNamespaces...)
	slices.Sort(out)
	return slices.Compact(out)
}

func (c *Config) validate() error {
	var errs []error
	if c.NodeName == "" {
		errs = append(errs, fmt.Errorf("node name is required (--node-name or %s)", EnvName("node-name")))
	}
	if _, port, _ := net.SplitHostPort(c.HealthAddr); c.MetricsAddr != "" && c.MetricsAddr == c.HealthAddr && port != "0" {
		errs = append(errs, fmt.Errorf("metrics-addr and health-addr are both %s: /metrics has its own address", c.HealthAddr))
	}
	if c.StartupTaintOnShutdown && !c.StartupTaint {
		errs = append(errs, errors.New("startup-taint-on-shutdown needs startup-taint (the agent would taint its node and never remove the taint)"))
	}
	// A client limit lowered below the annotation defaults (valid before
	// the annotation budget existed) takes the default budget down with it,
	// to 5/8 of the client's as the defaults are, instead of stopping the
	// agent on upgrade; only a budget set explicitly too high is refused.
	if c.AnnotationQPS == nodeagent.DefaultAnnotationQPS && c.AnnotationQPS >= c.KubeClientQPS {
		c.AnnotationQPS = c.KubeClientQPS * 5 / 8
	}
	if c.AnnotationBurst == nodeagent.DefaultAnnotationBurst && c.AnnotationBurst >= c.KubeClientBurst {
		c.AnnotationBurst = max(1, c.KubeClientBurst*5/8)
	}
	if c.AnnotationQPS >= c.KubeClientQPS || c.AnnotationBurst >= c.KubeClientBurst {
		errs = append(errs, fmt.Errorf("annotation-qps/-burst (%v/%d) must stay below kube-client-qps/-burst (%v/%d): annotation writes would take the whole client budget and hold up the requests captures make", c.AnnotationQPS, c.AnnotationBurst, c.KubeClientQPS, c.KubeClientBurst))
	}
	if c.PluginTimeout <= c.ZtunnelWait {
		errs = append(errs, fmt.Errorf("plugin-timeout (%s) must exceed ztunnel-wait (%s)", c.PluginTimeout, c.ZtunnelWait))
	}
	for _, d := range c.NetnsDirs {
		if !strings.HasPrefix(d, "/") {
			errs = append(errs, fmt.Errorf("netns dir %q is not absolute", d))
		}
	}
	for _, p := range []struct{ name, v string }{{"agent-socket", c.AgentSocket}, {"state-dir", c.StateDir}, {"zds-socket", c.ZDSSocket}, {"cni-bin-dir", c.CNIBinDir}, {"cni-conf-dir", c.CNIConfDir}} {
		if !strings.HasPrefix(p.v, "/") {
			errs = append(errs, fmt.Errorf("%s %q is not an absolute path", p.name, p.v))
		}
	}
	// The plugin refuses an entry whose istioCNIConfDir is not clean and
	// absolute, so the agent never writes one.
	if d := c.CNIHostConfDir; d != "" && (!path.IsAbs(d) || path.Clean(d) != d) {
		errs = append(errs, fmt.Errorf("cni-host-conf-dir %q is not a clean absolute path", d))
	}
	if slices.Contains(c.CNIExtraBinDirs, path.Clean(c.CNIBinDir)) {
		errs = append(errs, fmt.Errorf("cni-extra-bin-dirs lists cni-bin-dir %s again", path.Clean(c.CNIBinDir)))
	}
	return errors.Join(errs...)
}

// WriteMarkdown renders the settings table as Markdown documentation.
func WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	b.WriteString("| flag | environment | default | meaning |\n|---|---|---|---|\n")
	for _, o := range options() {
		def := "`" + o.def + "`"
		if o.def == "" {
			def = "(empty)"
		}
		help := o.help
		if o.alias() != "" {
			help += fmt.Sprintf(" Also read under its old name, `--%s` (`%s`).", o.alias(), EnvName(o.alias()))
		}
		fmt.Fprintf(&b, "| `--%s` | `%s` | %s | %s |\n", o.name, EnvName(o.name), def, help)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
