{{/* Names, labels and small derived values shared by every template. */}}

{{- define "ome-gateway-publisher.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ome-gateway-publisher.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ome-gateway-publisher.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ome-gateway-publisher.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ome-gateway-publisher.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ome-gateway-publisher.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
ome.io/gateway-publisher-instance: {{ .Values.instanceName }}
{{- end }}

{{- define "ome-gateway-publisher.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ome-gateway-publisher.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The gateway container the adapter writes to: "envoy", "nginx", or "" (httproute, json). */}}
{{- define "ome-gateway-publisher.gateway" -}}
{{- if has .Values.adapter.name (list "envoy" "nginx") }}{{ .Values.adapter.name }}{{ end }}
{{- end }}

{{- define "ome-gateway-publisher.leaseNamespace" -}}
{{- default .Release.Namespace .Values.leaderElection.leaseNamespace }}
{{- end }}

{{- define "ome-gateway-publisher.routeNamespace" -}}
{{- default .Release.Namespace .Values.adapter.httproute.routeNamespace }}
{{- end }}

{{/* Every container: no privilege escalation, no capabilities, read-only root filesystem. */}}
{{- define "ome-gateway-publisher.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* TrafficMaps and InferenceServices read, and this instance's status condition written. */}}
{{- define "ome-gateway-publisher.sourceRules" -}}
- apiGroups: ["ome.io"]
  resources: ["trafficmaps", "inferenceservices"]
  verbs: ["get", "list", "watch"]
{{- if .Values.reportStatus }}
- apiGroups: ["ome.io"]
  resources: ["trafficmaps/status"]
  verbs: ["patch"]
{{- end }}
{{- end }}

{{- define "ome-gateway-publisher.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
