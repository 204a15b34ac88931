{{/*
Name of every object of the release (DaemonSet, ServiceAccount, RBAC). The
agent reads its own DaemonSet by this name on shutdown, so the Role's
resourceNames and AMBIENT_DAEMONSET_NAME both come from here.
*/}}
{{- define "ambient-cni.fullname" -}}
{{- .Values.nameOverride | default (.Values.istioCompat.names | ternary "istio-cni-node" "ambient-cni") | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Name of the release's signal (release-signal.yaml): from the release's name
alone, never from nameOverride or istioCompat.names, so an upgrade that
renames the DaemonSet keeps it and is no uninstall. The agent's Role names
it, and AMBIENT_RELEASE_SIGNAL tells the agent and the uninstall hook.
*/}}
{{- define "ambient-cni.releaseSignal" -}}
{{- if contains "ambient-cni" .Release.Name -}}
{{- printf "%s-installed" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "ambient-cni-%s-installed" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ambient-cni.labels" -}}
{{ include "ambient-cni.selector" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels: immutable on a DaemonSet, so nothing that changes per release. */}}
{{- define "ambient-cni.selector" -}}
app.kubernetes.io/name: ambient-cni
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ambient-cni.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}{{ with .Values.image.tag }}:{{ . }}{{ end }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/*
Container paths of the host directories install-cni works on. The host side
comes from values; these stay fixed so the image and the env agree.
*/}}
{{- define "ambient-cni.containerBinDir" -}}/host/opt/cni/bin{{- end -}}
{{- define "ambient-cni.containerConfDir" -}}/host/etc/cni/net.d{{- end -}}
{{- define "ambient-cni.containerProc" -}}/host/proc{{- end -}}

{{/*
Container path of an extra bin dir (cni.extraBinDirs): its host path under
a prefix of its own, so it never lands on another mount (an extra
/opt/cni/bin beside GKE's binDir) and the agent's logs still name it.
*/}}
{{- define "ambient-cni.containerExtraBinDir" -}}/host/extra-cni-bin{{ clean . }}{{- end -}}

{{/*
The environment of install-cni: one AMBIENT_* variable per setting of
docs/install-cni.md (all but AMBIENT_KUBECONFIG: in-cluster configuration is
used), plus the API server override of apiServer.host. Paths the plugin also uses on the host (agent socket, netns dirs) are
mounted at the same path in the container, so one value serves both sides.
*/}}
{{- define "ambient-cni.env" -}}
- name: AMBIENT_NODE_NAME
  valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
- name: AMBIENT_POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: AMBIENT_POD_NAMESPACE
  valueFrom: {fieldRef: {fieldPath: metadata.namespace}}
- name: AMBIENT_DAEMONSET_NAME
  value: {{ include "ambient-cni.fullname" . | quote }}
- name: AMBIENT_RELEASE_SIGNAL
  value: {{ include "ambient-cni.releaseSignal" . | quote }}
- name: AMBIENT_CNI_BIN_DIR
  value: {{ include "ambient-cni.containerBinDir" . | quote }}
- name: AMBIENT_CNI_EXTRA_BIN_DIRS
  value: {{ $dirs := list }}{{ range (include "ambient-cni.layout" . | fromYaml).extraBinDirs }}{{ $dirs = append $dirs (include "ambient-cni.containerExtraBinDir" .) }}{{ end }}{{ join "," $dirs | quote }}
- name: AMBIENT_CNI_CONF_DIR
  value: {{ include "ambient-cni.containerConfDir" . | quote }}
- name: AMBIENT_CNI_HOST_CONF_DIR
  value: {{ (include "ambient-cni.layout" . | fromYaml).confDir | quote }}
- name: AMBIENT_CNI_CONF_NAME
  value: {{ .Values.cni.confName | quote }}
- name: AMBIENT_CNI_OWNED_CONFIG
  value: {{ .Values.cni.ownedConfig | quote }}
- name: AMBIENT_CNI_OWNED_CONF_NAME
  value: {{ .Values.cni.ownedConfName | quote }}
- name: AMBIENT_CNI_CHAIN_IN_NETWORK_FOLDER
  value: {{ .Values.cni.chainInNetworkFolder | quote }}
{{- if .Values.migration.fromIstioCNI.enabled }}
- name: AMBIENT_ISTIO_CNI_RUN_DIR
  value: {{ .Values.migration.fromIstioCNI.runDir | quote }}
- name: AMBIENT_ISTIO_CNI_DAEMONSET
  value: {{ .Values.migration.fromIstioCNI.daemonSet | quote }}
{{- end }}
- name: AMBIENT_CNI_PLUGIN_TYPE
  value: {{ .Values.cni.pluginType | quote }}
- name: AMBIENT_PLUGIN_BINARY
  value: {{ .Values.image.pluginBinary | quote }}
- name: AMBIENT_PLUGIN_TIMEOUT
  value: {{ .Values.cni.pluginTimeout | quote }}
- name: AMBIENT_PLUGIN_LOG_LEVEL
  value: {{ .Values.cni.pluginLogLevel | quote }}
- name: AMBIENT_PLUGIN_STATUS_CHECKS_AGENT
  value: {{ .Values.cni.statusChecksAgent | toString | quote }}
- name: AMBIENT_PLUGIN_AGENT_UNREACHABLE
  value: {{ .Values.cni.agentUnreachable | quote }}
- name: AMBIENT_PLUGIN_AGENT_DOWN_AFTER
  value: {{ .Values.cni.agentDownAfter | quote }}
- name: AMBIENT_AGENT_SOCKET
  value: {{ printf "%s/agent.sock" (.Values.agent.socketDir | trimSuffix "/") | quote }}
- name: AMBIENT_STATE_DIR
  value: {{ .Values.agent.stateDir | quote }}
- name: AMBIENT_ZDS_SOCKET
  value: {{ printf "%s/%s" (.Values.ztunnel.socketDir | trimSuffix "/") .Values.ztunnel.socketName | quote }}
- name: AMBIENT_PROC_ROOT
  value: {{ include "ambient-cni.containerProc" . | quote }}
- name: AMBIENT_NETNS_DIRS
  value: {{ join "," (include "ambient-cni.layout" . | fromYaml).netnsDirs | quote }}
- name: AMBIENT_EXCLUDED_NAMESPACES
  value: {{ join "," .Values.agent.excludedNamespaces | quote }}
- name: AMBIENT_DATA_PLANE_NAMESPACES
  value: {{ join "," .Values.agent.dataPlaneNamespaces | quote }}
- name: AMBIENT_CONTROL_PLANE_NAMESPACES
  value: {{ join "," (concat (include "ambient-cni.layout" . | fromYaml).systemNamespaces .Values.agent.controlPlaneNamespaces) | quote }}
- name: AMBIENT_PLUGIN_SERVICE_ACCOUNT
  value: {{ printf "%s-plugin" (include "ambient-cni.fullname" .) | quote }}
- name: AMBIENT_PLUGIN_TOKEN_LIFETIME
  value: {{ .Values.cni.pluginTokenLifetime | quote }}
- name: AMBIENT_ENABLEMENT_SELECTOR
  value: {{ .Values.ambient.enablementSelectors | toJson | quote }}
{{- if .Values.agent.assumePodLevelEnablement }}
{{- fail "agent.assumePodLevelEnablement was removed: with neither the agent nor the API server to ask, every pod outside the control plane's and the excluded namespaces already waits; to make the control plane's wait too, set cni.agentUnreachable=fail-closed" }}
{{- end }}
- name: AMBIENT_ZTUNNEL_WAIT
  value: {{ .Values.agent.ztunnelWait | quote }}
- name: AMBIENT_VERIFY_PERIOD
  value: {{ .Values.agent.verifyPeriod | quote }}
- name: AMBIENT_DNS_CAPTURE
  value: {{ .Values.agent.dnsCapture | toString | quote }}
- name: AMBIENT_RULES_BACKEND
  value: {{ .Values.agent.iptablesBackend | default .Values.agent.rulesBackend | quote }}
- name: AMBIENT_IPV6
  value: {{ .Values.ambient.ipv6 | toString | quote }}
- name: AMBIENT_PROBE_SNAT_IPV4
  value: {{ .Values.agent.probeSNATIPv4 | quote }}
- name: AMBIENT_PROBE_SNAT_IPV6
  value: {{ .Values.agent.probeSNATIPv6 | quote }}
- name: AMBIENT_HEALTH_ADDR
  value: {{ if .Values.agent.healthPort }}{{ printf ":%v" .Values.agent.healthPort | quote }}{{ else }}"off"{{ end }}
- name: AMBIENT_METRICS_ADDR
  value: {{ printf ":%v" .Values.agent.metricsPort | quote }}
- name: AMBIENT_LOG_LEVEL
  value: {{ .Values.agent.logLevel | quote }}
- name: AMBIENT_LOG_FORMAT
  value: {{ .Values.agent.logFormat | quote }}
- name: AMBIENT_KUBE_CLIENT_QPS
  value: {{ .Values.agent.kubeClientQPS | toString | quote }}
- name: AMBIENT_KUBE_CLIENT_BURST
  value: {{ .Values.agent.kubeClientBurst | int64 | toString | quote }}
- name: AMBIENT_ANNOTATION_QPS
  value: {{ .Values.agent.annotationQPS | toString | quote }}
- name: AMBIENT_ANNOTATION_BURST
  value: {{ .Values.agent.annotationBurst | int64 | toString | quote }}
- name: AMBIENT_STARTUP_TAINT
  value: {{ .Values.startupTaint.enabled | toString | quote }}
- name: AMBIENT_STARTUP_TAINT_ON_SHUTDOWN
  value: {{ .Values.startupTaint.restoreOnShutdown | toString | quote }}
{{- include "ambient-cni.apiServerEnv" . }}
{{- end -}}

{{/*
The API server override of apiServer.host: in-cluster client configuration
reads these two, and they win over the values kubelet derives from the
kubernetes Service. Empty when apiServer.host is.
*/}}
{{- define "ambient-cni.apiServerEnv" -}}
{{- with .Values.apiServer.host }}
- name: KUBERNETES_SERVICE_HOST
  value: {{ . | quote }}
- name: KUBERNETES_SERVICE_PORT
  value: {{ $.Values.apiServer.port | toString | quote }}
{{- end }}
{{- end -}}

{{/*
The platform's name: the platform value, or gke when it is empty and the
cluster's version says GKE (as istio-cni detects GKE's bin dir). Empty on
any other cluster, and under helm template without --kube-version.
*/}}
{{- define "ambient-cni.platformName" -}}
{{- $name := .Values.platform -}}
{{- if and (not $name) (contains "-gke" .Capabilities.KubeVersion.Version) -}}
{{- $name = "gke" -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{/*
The node layout of files/platforms.yaml for the platform, as YAML: generic
with the platform's entries over it. Values the user sets win over it (see
ambient-cni.layout).
*/}}
{{- define "ambient-cni.platform" -}}
{{- $all := .Files.Get "files/platforms.yaml" | fromYaml -}}
{{- $p := deepCopy $all.generic -}}
{{- with include "ambient-cni.platformName" . -}}
{{- if not (hasKey $all .) -}}
{{- fail (printf "platform %q is not one of the chart's platforms" .) -}}
{{- end -}}
{{- $p = mustMergeOverwrite $p (deepCopy (get $all .)) -}}
{{- end -}}
{{- toYaml $p -}}
{{- end -}}

{{/*
What the templates use: the platform's layout with every value the user set
over it (an empty value is unset).
*/}}
{{- define "ambient-cni.layout" -}}
{{- $p := include "ambient-cni.platform" . | fromYaml -}}
{{- $rq := .Values.resourceQuotas.enabled -}}
{{- if kindIs "bool" $rq -}}
{{- $_ := set $p "resourceQuota" $rq -}}
{{- end -}}
{{- $_ := set $p "binDir" (.Values.cni.binDir | default $p.binDir) -}}
{{- $_ := set $p "confDir" (.Values.cni.confDir | default $p.confDir) -}}
{{- $_ := set $p "extraBinDirs" (.Values.cni.extraBinDirs | default $p.extraBinDirs | default (list)) -}}
{{- $seen := list (clean $p.binDir) -}}
{{- range $p.extraBinDirs -}}
{{- if has (clean .) $seen -}}
{{- fail (printf "cni.extraBinDirs: %s is listed twice (cni.binDir is %s)" (clean .) (clean $p.binDir)) -}}
{{- end -}}
{{- $seen = append $seen (clean .) -}}
{{- end -}}
{{- $_ := set $p "netnsDirs" (.Values.cni.netnsDirs | default $p.netnsDirs) -}}
{{- $_ := set $p "seLinuxOptions" (.Values.securityContext.seLinuxOptions | default $p.seLinuxOptions) -}}
{{- toYaml $p -}}
{{- end -}}

{{/*
Istio's values (docs/migrating-from-istio-cni.md has the table). An
istio-cni values file carries the istio/cni chart's keys at the top level,
under cni (Istio's chart copies cni.* over the top level, so cni wins) and
under global. Each either sets ours with Istio's meaning or fails, naming
ours or saying why there is none; a few that only steer Istio's own agent
are accepted without effect. It rewrites .Values in place, once:
templates/zzz_istio-values.yaml includes it, and helm renders a chart's
templates in reverse name order, so before every other template (Istio's
charts rely on the same order).
*/}}
{{- define "ambient-cni.istioValues" -}}
{{- $v := .Values -}}
{{- if not (hasKey $v "_istioValuesApplied") -}}
{{- $_ := set $v "_istioValuesApplied" true -}}
{{- $g := $v.global | default dict -}}
{{- $cni := $v.cni -}}
{{- if hasKey $v "_internal_defaults_do_not_set" -}}
{{- fail "_internal_defaults_do_not_set: Istio's chart defaults, as helm show values prints them; keep only the keys you changed, at the top level" -}}
{{- end -}}
{{- /* Istio's own keys: top level, then cni.* over them. */ -}}
{{- $i := dict -}}
{{- $keys := list "hub" "tag" "variant" "pullPolicy" "logging" "cniBinDir" "cniConfDir" "cniConfFileName" "cniNetnsDir" "istioOwnedCNIConfigFileName" "istioOwnedCNIConfig" "excludeNamespaces" "daemonSetLabels" "chained" "provider" "repair" "seccompProfile" "seLinuxOptions" "useAppArmorAnnotation" "revision" "ownerName" "env" -}}
{{- range $k := $keys -}}
{{- if hasKey $v $k -}}{{- $_ := set $i $k (index $v $k) -}}{{- end -}}
{{- if hasKey $cni $k -}}{{- $_ := set $i $k (index $cni $k) -}}{{- end -}}
{{- end -}}
{{- /* Keys both charts have, with one meaning: cni.* over ours. */ -}}
{{- range $k := list "affinity" "podAnnotations" "podLabels" "resources" "resourceQuotas" "tolerations" "updateStrategy" "terminationGracePeriodSeconds" "ambient" -}}
{{- if hasKey $cni $k -}}
{{- $new := index $cni $k -}}
{{- if and (kindIs "map" $new) (kindIs "map" (index $v $k)) -}}
{{- $new = mustMergeOverwrite (deepCopy (index $v $k)) $new -}}
{{- end -}}
{{- $_ := set $v $k $new -}}
{{- end -}}
{{- end -}}
{{- /* The image is ours. */ -}}
{{- if or (kindIs "string" $v.image) (hasKey $cni "image") -}}
{{- fail (printf "image: %v is Istio's install-cni image name; ambient-cni runs its own image: set image.repository and image.tag (empty: the chart's version), or drop image" (ternary $v.image $cni.image (kindIs "string" $v.image))) -}}
{{- end -}}
{{- range $k := list "hub" "tag" "variant" -}}
{{- with index $i $k -}}
{{- fail (printf "%s: %v names Istio's install-cni image; ambient-cni runs its own: set image.repository and image.tag instead" $k .) -}}
{{- end -}}
{{- end -}}
{{- /* Istio's global.hub and global.tag say where a user's images come
from (often a mirror). While image.repository is still the source tree's
placeholder, which publishes nothing yet (values.yaml), our image would be
pulled from there: refuse and name the key to set. Once image.repository
is set (a release's chart sets it), they concern Istio's images only. */ -}}
{{- if eq $v.image.repository "ghcr.io/ambient-cni/ambient-cni" -}}
{{- range $k := list "hub" "tag" -}}
{{- with index $g $k -}}
{{- fail (printf "global.%s: %v is for Istio's images; ambient-cni's image is image.repository, still the chart's placeholder %s (nothing is published there yet): set image.repository (and image.tag or image.digest) to where ambient-cni's image is" $k . $v.image.repository) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with index $i "pullPolicy" | default $g.imagePullPolicy -}}
{{- $_ := set $v.image "pullPolicy" . -}}
{{- end -}}
{{- /* Istio's level: bare, or the default scope's of a scoped list. */ -}}
{{- with (index $i "logging" | default dict).level | default ($g.logging | default dict).level -}}
{{- $level := "" -}}
{{- range $part := splitList "," . -}}
{{- $kv := splitList ":" (trim $part) -}}
{{- if eq (len $kv) 1 -}}{{- $level = first $kv -}}
{{- else if eq (first $kv) "default" -}}{{- $level = last $kv -}}
{{- end -}}
{{- end -}}
{{- $levels := dict "debug" "debug" "info" "info" "warn" "warn" "warning" "warn" "error" "error" "fatal" "error" "none" "error" -}}
{{- if not (hasKey $levels $level) -}}
{{- fail (printf "logging.level %q: ambient-cni's agent has one level (agent.logLevel: debug, info, warn or error; Istio's fatal and none become error), given bare or as Istio's default scope (default:debug)" .) -}}
{{- end -}}
{{- $_ := set $v.agent "logLevel" (index $levels $level) -}}
{{- end -}}
{{- /* Node layout. */ -}}
{{- if and (not $v.platform) $g.platform -}}
{{- $_ := set $v "platform" $g.platform -}}
{{- end -}}
{{- range $pair := list (list "cniBinDir" "binDir") (list "cniConfDir" "confDir") (list "cniConfFileName" "confName") -}}
{{- $istio := first $pair -}}
{{- $ours := last $pair -}}
{{- with index $i $istio -}}
{{- if and (index $cni $ours) (ne (index $cni $ours) .) -}}
{{- fail (printf "%s (Istio's name) and cni.%s disagree; keep cni.%s" $istio $ours $ours) -}}
{{- end -}}
{{- $_ := set $cni $ours . -}}
{{- end -}}
{{- end -}}
{{- with index $i "cniNetnsDir" -}}
{{- $dirs := $cni.netnsDirs | default (include "ambient-cni.platform" $ | fromYaml).netnsDirs -}}
{{- if not (has . $dirs) -}}{{- $dirs = append $dirs . -}}{{- end -}}
{{- $_ := set $cni "netnsDirs" $dirs -}}
{{- end -}}
{{- /* Istio's default (false) leaves cni.ownedConfig as set. */ -}}
{{- if index $i "istioOwnedCNIConfig" -}}
{{- $_ := set $cni "ownedConfig" true -}}
{{- end -}}
{{- with index $i "istioOwnedCNIConfigFileName" -}}
{{- $_ := set $cni "ownedConfName" . -}}
{{- end -}}
{{- if and (hasKey $i "chained") (not (index $i "chained")) -}}
{{- fail "chained: false (a standalone config file, as for Multus): ambient-cni always chains into the primary network's config; on OpenShift set platform: openshift, which chains after Multus" -}}
{{- end -}}
{{- with index $i "provider" -}}
{{- if ne . "default" -}}
{{- fail (printf "provider: %q: ambient-cni has no provider setting; it chains into the primary config (with Multus on OpenShift: platform: openshift)" .) -}}
{{- end -}}
{{- end -}}
{{- /* What is captured. */ -}}
{{- if hasKey $i "excludeNamespaces" -}}
{{- $_ := set $v.agent "excludedNamespaces" (index $i "excludeNamespaces" | default (list)) -}}
{{- end -}}
{{- $a := $v.ambient -}}
{{- if and (hasKey $a "enabled") (not $a.enabled) -}}
{{- fail "ambient.enabled: false is istio-cni for sidecars only; ambient-cni serves ambient mode only, always on: drop ambient.enabled (and keep istio-cni while sidecars rely on it)" -}}
{{- end -}}
{{- if hasKey $a "dnsCapture" -}}
{{- $_ := set $v.agent "dnsCapture" $a.dnsCapture -}}
{{- end -}}
{{- if and (hasKey $a "reconcileIptablesOnStartup") (not $a.reconcileIptablesOnStartup) -}}
{{- fail "ambient.reconcileIptablesOnStartup: false: ambient-cni always brings captured pods' rules up to date at startup (Istio's default, true); drop it" -}}
{{- end -}}
{{- if and (hasKey $a "shareHostNetworkNamespace") (not $a.shareHostNetworkNamespace) -}}
{{- fail "ambient.shareHostNetworkNamespace: false: ambient-cni's agent always runs in the host network namespace (as true); drop it" -}}
{{- end -}}
{{- with index $i "repair" -}}
{{- if or (not (hasKey . "enabled")) .enabled -}}
{{- fail "repair: istio-cni's repair of sidecar pods (its istio-validation init container); ambient-cni has no sidecar mode and nothing to repair: drop repair or set repair.enabled: false" -}}
{{- end -}}
{{- end -}}
{{- /* The container. */ -}}
{{- with index $i "seccompProfile" -}}
{{- $_ := set $v.securityContext "seccompProfile" . -}}
{{- end -}}
{{- with index $i "seLinuxOptions" -}}
{{- $_ := set $v.securityContext "seLinuxOptions" (merge (deepCopy .) (dict "type" "spc_t")) -}}
{{- end -}}
{{- if hasKey $i "daemonSetLabels" -}}
{{- $_ := set $v "daemonSetLabels" (index $i "daemonSetLabels") -}}
{{- end -}}
{{- with index $i "revision" -}}
{{- fail (printf "revision: %q: ambient-cni is one node agent for the whole cluster, serving every revision's ztunnel; drop revision" .) -}}
{{- end -}}
{{- with index $i "env" -}}
{{- fail "env: istio-cni's own environment; ambient-cni's settings are the chart's values (docs/install-cni.md); other variables go in extraEnv, a list of name and value" -}}
{{- end -}}
{{- /* Profiles: only the ambient one means something here. */ -}}
{{- with $v.profile | default $cni.profile | default $g.profile -}}
{{- if ne . "ambient" -}}
{{- fail (printf "profile: %q: Istio's profiles other than ambient leave istio-cni in sidecar mode; ambient-cni is always in ambient mode: use profile: ambient or none" .) -}}
{{- end -}}
{{- end -}}
{{- with $v.compatibilityVersion -}}
{{- if not (semverCompare ">=1.29.0-0" (printf "%v.0" .)) -}}
{{- fail (printf "compatibilityVersion: %v: before 1.29 istio-cni left captured pods' rules alone at startup; ambient-cni always brings them up to date, as Istio does from 1.29: use 1.29 or later, or none" .) -}}
{{- end -}}
{{- end -}}
{{- /* Istio's globals the CNI chart reads; the rest concern other charts. */ -}}
{{- /* Istio's JSON logs are ours (agent.logFormat), unless that is set otherwise. */ -}}
{{- if and $g.logAsJson (eq $v.agent.logFormat "text") -}}
{{- $_ := set $v.agent "logFormat" "json" -}}
{{- end -}}
{{- with $g.resourceScope -}}
{{- if ne . "all" -}}
{{- fail (printf "global.resourceScope: %q: the chart installs all of its objects in one release (all)" .) -}}
{{- end -}}
{{- end -}}
{{- with $g.imagePullSecrets -}}
{{- $s := $v.imagePullSecrets | default (list) -}}
{{- range . -}}
{{- $s = append $s (ternary (dict "name" .) . (kindIs "string" .)) -}}
{{- end -}}
{{- $_ := set $v "imagePullSecrets" $s -}}
{{- end -}}
{{- if and (not $v.resources) $g.defaultResources -}}
{{- $_ := set $v "resources" $g.defaultResources -}}
{{- end -}}
{{- if and (hasKey $g "nativeNftables") (eq $v.agent.rulesBackend "auto") (not $v.agent.iptablesBackend) -}}
{{- $_ := set $v.agent "rulesBackend" (ternary "nftables" "iptables" $g.nativeNftables) -}}
{{- end -}}
{{- /* Istio's names: its metrics port with them, unless another is set. */ -}}
{{- if and $v.istioCompat.names (eq (int $v.agent.metricsPort) 9974) -}}
{{- $_ := set $v.agent "metricsPort" 15014 -}}
{{- end -}}
{{- end -}}
{{- end -}}
