{{/*
Name of every object of the release (DaemonSet, ServiceAccount, RBAC). The
agent reads its own DaemonSet by this name on shutdown, so the Role's
resourceNames and AMBIENT_DAEMONSET_NAME both come from here.
*/}}
{{- define "ambient-cni.fullname" -}}
{{- .Values.nameOverride | default "ambient-cni" | trunc 63 | trimSuffix "-" -}}
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
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
Container paths of the host directories install-cni works on. The host side
comes from values; these stay fixed so the image and the env agree.
*/}}
{{- define "ambient-cni.containerBinDir" -}}/host/opt/cni/bin{{- end -}}
{{- define "ambient-cni.containerConfDir" -}}/host/etc/cni/net.d{{- end -}}
{{- define "ambient-cni.containerProc" -}}/host/proc{{- end -}}

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
- name: AMBIENT_CNI_BIN_DIR
  value: {{ include "ambient-cni.containerBinDir" . | quote }}
- name: AMBIENT_CNI_CONF_DIR
  value: {{ include "ambient-cni.containerConfDir" . | quote }}
- name: AMBIENT_CNI_CONF_NAME
  value: {{ .Values.cni.confName | quote }}
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
- name: AMBIENT_ENABLEMENT_SELECTOR
  value: {{ .Values.ambient.enablementSelectors | toJson | quote }}
- name: AMBIENT_ASSUME_POD_LEVEL_ENABLEMENT
  value: {{ .Values.agent.assumePodLevelEnablement | toString | quote }}
- name: AMBIENT_ZTUNNEL_WAIT
  value: {{ .Values.agent.ztunnelWait | quote }}
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
{{- $_ := set $p "netnsDirs" (.Values.cni.netnsDirs | default $p.netnsDirs) -}}
{{- $_ := set $p "seLinuxOptions" (.Values.securityContext.seLinuxOptions | default $p.seLinuxOptions) -}}
{{- toYaml $p -}}
{{- end -}}
