// Package ambient is the contract between the CNI plugin and the node
// agent, and with Istio: Kubernetes label and annotation keys, ztunnel
// ports, packet marks and default node paths; the plugin↔agent wire types
// with the strict decoders the agent accepts requests through and the
// client the plugin sends them with; and the plugin's conflist entry
// (PluginConf), which the installer writes and the plugin reads. The plugin
// binary and the agent both import it, so it needs only the standard
// library. The enablement policy (Kubernetes API types) is in the
// enablement subpackage, the files the plugin and agent share on the node
// in nodefiles, the ZDS messages the agent and ztunnel exchange in zdspb,
// the explain report the agent answers and kubectl ambient-cni renders in
// explainwire.
//
// Every key, port and mark here is an interface fact that the real ztunnel
// and istiod depend on; change none of them without checking the
// compatibility spec.
package ambient

import "net/netip"

// Kubernetes label and annotation keys.
const (
	// DataplaneModeLabel enables (value DataplaneModeAmbient) a namespace or
	// pod, or opts a pod out (value DataplaneModeNone).
	DataplaneModeLabel = "istio.io/dataplane-mode"
	// DataplaneModeAmbient is the label value that enables ambient capture.
	DataplaneModeAmbient = "ambient"
	// DataplaneModeNone is the pod label value that opts a pod out.
	DataplaneModeNone = "none"

	// RedirectionAnnotation records a pod's capture state for istiod.
	RedirectionAnnotation = "ambient.istio.io/redirection"
	// RedirectionPending means the rules are in place but ztunnel has not acked.
	RedirectionPending = "pending"
	// RedirectionEnabled means ztunnel acknowledged the pod.
	RedirectionEnabled = "enabled"

	// SidecarStatusAnnotation marks a sidecar-injected pod; such pods are never enrolled.
	SidecarStatusAnnotation = "sidecar.istio.io/status"
	// IstioValidationInitContainer is the init container Istio's sidecar
	// injector adds instead of istio-init when istio-cni sets up the
	// sidecar's redirection (pilot.cni.enabled): it only checks that the
	// redirection works, and keeps the pod from starting when it does not.
	IstioValidationInitContainer = "istio-validation"
	// DNSCaptureAnnotation overrides DNS capture per pod ("true"/"false").
	DNSCaptureAnnotation = "ambient.istio.io/dns-capture"
	// BypassInboundCaptureAnnotation disables inbound redirection when "true".
	BypassInboundCaptureAnnotation = "ambient.istio.io/bypass-inbound-capture"
	// RerouteVirtualInterfacesAnnotation lists (comma-separated) the pod's
	// virtual interfaces (KubeVirt's bridge, say) whose incoming TCP is
	// redirected as outbound traffic.
	RerouteVirtualInterfacesAnnotation = "istio.io/reroute-virtual-interfaces"

	// DefaultExcludedNamespace is never enrolled unless configured otherwise.
	DefaultExcludedNamespace = "kube-system"
)

// ztunnel ports inside the pod network namespace.
const (
	// ZtunnelOutboundPort receives redirected outbound TCP.
	ZtunnelOutboundPort = 15001
	// ZtunnelInboundPlaintextPort receives redirected inbound TCP.
	ZtunnelInboundPlaintextPort = 15006
	// ZtunnelInboundHBONEPort is reached directly and never redirected.
	ZtunnelInboundHBONEPort = 15008
	// ZtunnelDNSPort receives captured DNS (UDP and TCP).
	ZtunnelDNSPort = 15053
	// DNSPort is the port DNS capture matches.
	DNSPort = 53
)

// Marks and policy routing.
const (
	// ZtunnelMark is the SO_MARK ztunnel sets on its own sockets.
	ZtunnelMark uint32 = 0x539
	// ConnSkipMark is the connmark for replies of ztunnel-originated inbound conns.
	ConnSkipMark uint32 = 0x111
	// MarkMask is the mask used with both marks.
	MarkMask uint32 = 0xfff
	// RouteTable is the policy-routing table that keeps ConnSkipMark traffic local.
	RouteTable = 100
	// RulePriority is the ip rule priority used for the ConnSkipMark rule.
	RulePriority = 32764
)

// Default kubelet probe SNAT sources (configurable).
var (
	// DefaultProbeSNATv4 is the IPv4 source kubelet probes are SNATed to.
	DefaultProbeSNATv4 = netip.MustParseAddr("169.254.7.127")
	// DefaultProbeSNATv6 is the IPv6 source kubelet probes are SNATed to.
	DefaultProbeSNATv6 = netip.MustParseAddr("fd16:9254:7127:1337:ffff:ffff:ffff:ffff")
)

// Default filesystem locations on the node.
const (
	// DefaultZDSSocket is where the agent listens for ztunnel.
	DefaultZDSSocket = "/var/run/ztunnel/ztunnel.sock"
	// IstioCNIEventSocket is the socket istio-cni's plugin reaches its node
	// agent on, in istio-cni's run directory (its chart's
	// /var/run/istio-cni).
	IstioCNIEventSocket = "pluginevent.sock"
	// DefaultAgentSocket is where the agent listens for the CNI plugin;
	// the files it shares with the plugin live beside it (see nodefiles).
	DefaultAgentSocket = "/var/run/ambient-cni/agent.sock"
	// DefaultStateDir is the agent's persistent node directory: on the
	// host's disk, not tmpfs, so what the plugin decides by when the agent
	// cannot answer survives a reboot (see nodefiles.Layout.StateDir).
	DefaultStateDir = "/var/lib/ambient-cni"
)
