{{- define "ambient-cni.name" -}}ambient-cni{{- end -}}

{{- define "ambient-cni.labels" -}}
app.kubernetes.io/name: ambient-cni
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "ambient-cni.selector" -}}
app.kubernetes.io/name: ambient-cni
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ambient-cni.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
