// Package metrics defines install-cni's Prometheus metrics, which it wires
// to the agent, the servers, the controller and the installer, and keeps
// the gauges current (RunGauges). Beside ours (ambient_cni_*) it serves the
// istio-cni node agent's metrics that have a meaning here, under Istio's
// names and labels, so existing dashboards and alerts keep working. They
// live on a registry the caller owns
// (no global registration), so tests and several agents in one process
// never collide.
package metrics

import (
	"context"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/ambient-cni/ambient-cni/pkg/ambient"
	"github.com/ambient-cni/ambient-cni/pkg/buildinfo"
)

const namespace = "ambient_cni"

// Metrics holds every metric the node agent exports.
type Metrics struct {
	// Registry is what /metrics serves.
	Registry *prometheus.Registry
	// CNIRequests counts plugin requests by verb (ADD, DEL, CHECK, GC,
	// STATUS) and result (enrolled, not-enrolled, removed, ok, error, retry).
	CNIRequests *prometheus.CounterVec
	// AddLatency observes the agent's handling time of CNI ADD.
	AddLatency prometheus.Histogram
	// AddZtunnelAck observes, for each pod a CNI ADD captured, the time
	// from the ADD's arrival at the agent to ztunnel's ack of the pod.
	AddZtunnelAck prometheus.Histogram
	// StartToZtunnel observes, once per agent start, the time from the
	// start to the first ztunnel connection whose snapshot ztunnel
	// acknowledged: from then on pods can be captured.
	StartToZtunnel prometheus.Histogram
	// EnrolledPods is the number of enrolled pods by redirection state.
	EnrolledPods *prometheus.GaugeVec
	// ZtunnelConnections is the number of connected ztunnels.
	ZtunnelConnections prometheus.Gauge
	// TrackedPods is how many pods each of the agent's per-pod tables
	// holds, by table: each returns to its size once those pods are gone
	// (memory bounded by the pods that exist).
	TrackedPods *prometheus.GaugeVec
	// RuleErrors counts failed in-pod rule operations by op (apply, verify, remove).
	RuleErrors *prometheus.CounterVec
	// RuleDrift counts verifications that found drift and repaired it.
	RuleDrift prometheus.Counter
	// VerifyDrift counts what the verifier found drifted on captured
	// pods (or a pod found uncaptured), by kind; PodsUnproven is how many
	// pods are not proven captured now (0 on a healthy node).
	VerifyDrift  *prometheus.CounterVec
	PodsUnproven prometheus.Gauge
	// NetnsScans counts /proc passes made to find running pods' network
	// namespaces; one serves a whole batch of pods.
	NetnsScans prometheus.Counter
	// BuildInfo is 1, labelled with the agent's version and commit
	// (ambient_cni_build_info; istio-cni serves no build metric).
	BuildInfo *prometheus.GaugeVec
	// InstallerReinstalls counts how often the installer restored the
	// plugin binary or its conflist entry.
	InstallerReinstalls prometheus.Counter
	// PluginCredentialIssued and PluginCredentialExpiry are when the
	// token in the plugin's own API credential was issued and when it
	// expires (Unix seconds; 0 while the agent has none): its age is
	// time() minus the first. PluginCredentialFailures counts failed
	// attempts to obtain or renew it. The plugin reads the credential
	// only while the agent cannot answer; once expired, pods it cannot
	// vouch for wait for the agent.
	PluginCredentialIssued   prometheus.Gauge
	PluginCredentialExpiry   prometheus.Gauge
	PluginCredentialFailures prometheus.Counter

	// IstioInstallReady is istio-cni's istio_cni_install_ready: 1 while
	// the plugin is installed and chained, else 0.
	IstioInstallReady prometheus.Gauge
	// IstioZtunnelConnected is istio-cni's ztunnel_connected: the number of
	// ztunnels connected over ZDS.
	IstioZtunnelConnected prometheus.Gauge
	// IstioPluginRequests is istio-cni's istio_cni_plugin_requests_total:
	// the CNI ADDs of pods in the mesh, by response_code (the HTTP status
	// the agent answered the plugin with). istio-cni's plugin forwards only
	// those (it checks exclusions and enablement itself); ours forwards
	// every ADD, so the ADDs the agent found outside the mesh are left out.
	// Count through ObserveRequest.
	IstioPluginRequests *prometheus.CounterVec
	// IstioInstalls is istio-cni's istio_cni_installs_total, by result:
	// SUCCESS each time the plugin became installed (the first complete
	// install, every repair), COPY_BINARIES_FAILURE and
	// CREATE_CNI_CONFIG_FAILURE per failed attempt. Istio's
	// CREATE_KUBECONFIG_FAILURE never occurs: the plugin uses no
	// kubeconfig. Count through ObserveInstall.
	IstioInstalls *prometheus.CounterVec
	// IstioReconcileEvents is istio-cni's nodeagent_reconcile_events_total:
	// informer events of this node's pods and of namespaces, by type (add,
	// update, delete).
	IstioReconcileEvents *prometheus.CounterVec
}

// istio_cni_installs_total's result values (Istio's).
const (
	InstallSuccess       = "SUCCESS"
	InstallCopyFailure   = "COPY_BINARIES_FAILURE"
	InstallConfigFailure = "CREATE_CNI_CONFIG_FAILURE"
)

// New creates the metrics on a fresh registry that also carries the Go
// runtime and process collectors.
func New() *Metrics {
	r := prometheus.NewRegistry()
	m := &Metrics{
		Registry: r,
		CNIRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "cni_requests_total",
			Help: "CNI plugin requests handled by the agent, by verb and result.",
		}, []string{"verb", "result"}),
		AddLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: namespace, Name: "cni_add_duration_seconds",
			Help:    "Time the agent took to answer a CNI ADD.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}),
		AddZtunnelAck: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: namespace, Name: "cni_add_ztunnel_ack_seconds",
			Help:    "Time from a CNI ADD's arrival at the agent to ztunnel's ack of the pod it captured.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}),
		StartToZtunnel: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: namespace, Name: "start_to_ztunnel_seconds",
			Help:    "Time from the agent's start to the first ztunnel connection whose snapshot ztunnel acknowledged, once per start.",
			Buckets: []float64{.1, .25, .5, 1, 2, 5, 10, 15, 30, 60, 120, 300},
		}),
		EnrolledPods: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "enrolled_pods",
			Help: "Pods enrolled in the mesh on this node, by redirection state.",
		}, []string{"state"}),
		ZtunnelConnections: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "ztunnel_connections",
			Help: "ztunnel instances connected over ZDS.",
		}),
		TrackedPods: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "agent_tracked_pods",
			Help: "Pods held in each of the agent's per-pod tables, by table.",
		}, []string{"table"}),
		RuleErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "rule_errors_total",
			Help: "Failed in-pod rule operations, by operation.",
		}, []string{"op"}),
		RuleDrift: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "rule_drift_repairs_total",
			Help: "In-pod rule sets found drifted and re-applied.",
		}),
		VerifyDrift: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: namespace, Name: "verify_drift_total",
			Help: "Drift the verifier found on captured pods and repaired, by kind (rules, ztunnel, probe_set, annotation, sandbox, uncaptured).",
		}, []string{"kind"}),
		PodsUnproven: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "pods_unproven",
			Help: "Pods on this node that should be captured and whose capture the verifier has not proven now; 0 on a healthy node.",
		}),
		NetnsScans: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "netns_scans_total",
			Help: "Passes over /proc to find running pods' network namespaces (one per batch of pods).",
		}),
		InstallerReinstalls: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "installer_reinstalls_total",
			Help: "Times the installer restored the plugin binary or its config entry.",
		}),
		PluginCredentialIssued: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "plugin_credential_issued_timestamp_seconds",
			Help: "When the token of the plugin's API credential in place was issued (Unix seconds); 0 while there is none.",
		}),
		PluginCredentialExpiry: prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: namespace, Name: "plugin_credential_expiry_timestamp_seconds",
			Help: "When the token of the plugin's API credential in place expires (Unix seconds); 0 while there is none.",
		}),
		PluginCredentialFailures: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "plugin_credential_renewal_failures_total",
			Help: "Failed attempts to obtain or renew the plugin's API credential.",
		}),
		BuildInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "build_info",
			Help: "Always 1; labels: the agent's version and commit.",
		}, []string{"version", "commit"}),
		IstioInstallReady: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "istio_cni_install_ready",
			Help: "Whether the CNI plugin installation is ready (1) or not (0); istio-cni's name.",
		}),
		IstioZtunnelConnected: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "ztunnel_connected",
			Help: "Number of connections to ztunnel; istio-cni's name.",
		}),
		IstioPluginRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_cni_plugin_requests_total",
			Help: "CNI plugin ADD requests of pods in the mesh handled by the node agent, by response code; istio-cni's name.",
		}, []string{"response_code"}),
		IstioInstalls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "istio_cni_installs_total",
			Help: "Total number of CNI plugins installed by the CNI installer, by result; istio-cni's name.",
		}, []string{"result"}),
		IstioReconcileEvents: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "nodeagent_reconcile_events_total",
			Help: "The total number of node agent reconcile events (pod and namespace informer events), by type; istio-cni's name.",
		}, []string{"type"}),
	}
	r.MustRegister(m.CNIRequests, m.AddLatency, m.AddZtunnelAck, m.StartToZtunnel, m.EnrolledPods, m.ZtunnelConnections, m.TrackedPods,
		m.RuleErrors, m.RuleDrift, m.VerifyDrift, m.PodsUnproven, m.NetnsScans, m.InstallerReinstalls, m.BuildInfo,
		m.PluginCredentialIssued, m.PluginCredentialExpiry, m.PluginCredentialFailures,
		m.IstioInstallReady, m.IstioZtunnelConnected, m.IstioPluginRequests, m.IstioInstalls, m.IstioReconcileEvents,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	m.BuildInfo.WithLabelValues(buildinfo.Version(), buildinfo.Commit()).Set(1)
	// Label values known up front appear at zero, so dashboards and alerts
	// see the series before the first event.
	for _, op := range []string{"apply", "verify", "remove"} {
		m.RuleErrors.WithLabelValues(op)
	}
	for _, st := range podStates {
		m.EnrolledPods.WithLabelValues(st)
	}
	for _, r := range []string{InstallSuccess, InstallCopyFailure, InstallConfigFailure} {
		m.IstioInstalls.WithLabelValues(r)
	}
	for _, e := range []string{"add", "update", "delete"} {
		m.IstioReconcileEvents.WithLabelValues(e)
	}
	return m
}

// ObservePluginCredential sets the plugin credential's issue and expiry
// times.
func (m *Metrics) ObservePluginCredential(issued, expires time.Time) {
	m.PluginCredentialIssued.Set(unixSeconds(issued))
	m.PluginCredentialExpiry.Set(unixSeconds(expires))
}

func unixSeconds(t time.Time) float64 {
	if t.IsZero() {
		return 0
	}
	return float64(t.UnixMilli()) / 1000
}

// ObserveInstall counts one result of the installer in IstioInstalls
// (InstallSuccess, InstallCopyFailure or InstallConfigFailure).
func (m *Metrics) ObserveInstall(result string) {
	m.IstioInstalls.WithLabelValues(result).Inc()
}

// ObserveEvent counts one informer event (add, update, delete) in
// IstioReconcileEvents.
func (m *Metrics) ObserveEvent(event string) {
	m.IstioReconcileEvents.WithLabelValues(event).Inc()
}

// podStates are the EnrolledPods label values: the redirection states.
var podStates = []string{ambient.RedirectionPending, ambient.RedirectionEnabled}

// ObserveRequest counts one plugin request the agent answered: verb and
// result in CNIRequests, the handling time of an ADD in AddLatency, and the
// HTTP status (code) of an ADD of a pod in the mesh (any result but
// not-enrolled) in IstioPluginRequests.
func (m *Metrics) ObserveRequest(verb, result string, code int, took time.Duration) {
	m.CNIRequests.WithLabelValues(verb, result).Inc()
	if verb == "ADD" {
		m.AddLatency.Observe(took.Seconds())
		if result != string(ambient.VerdictNotEnrolled) {
			m.IstioPluginRequests.WithLabelValues(strconv.Itoa(code)).Inc()
		}
	}
}

// gaugeInterval is how often RunGauges samples.
const gaugeInterval = 2 * time.Second

// RunGauges keeps EnrolledPods (from pods: count per state),
// ZtunnelConnections and IstioZtunnelConnected (from ztunnels),
// IstioInstallReady (from installed) and TrackedPods (from tables, when not
// nil: count per table) current, sampling every gaugeInterval until ctx
// ends.
func (m *Metrics) RunGauges(ctx context.Context, pods func() map[string]int, ztunnels func() int, installed func() bool, tables func() map[string]int) error {
	t := time.NewTicker(gaugeInterval)
	defer t.Stop()
	for {
		counts := pods()
		for _, st := range podStates {
			m.EnrolledPods.WithLabelValues(st).Set(float64(counts[st]))
		}
		n := float64(ztunnels())
		m.ZtunnelConnections.Set(n)
		m.IstioZtunnelConnected.Set(n)
		ready := 0.0
		if installed() {
			ready = 1
		}
		m.IstioInstallReady.Set(ready)
		if tables != nil {
			for table, n := range tables() {
				m.TrackedPods.WithLabelValues(table).Set(float64(n))
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
