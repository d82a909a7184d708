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
{{ include "ome-gateway-publisher.instanceLabel" . }}
{{- end }}

{{/* The label the alerts select on; on the pods too, so a PodMonitor or a labelmap finds it. */}}
{{- define "ome-gateway-publisher.instanceLabel" -}}
ome.io/gateway-publisher-instance: {{ include "ome-gateway-publisher.region" . }}
{{- end }}

{{/* The region: region, else instanceName (its old key, deprecated for one release), else the
release name; a DNS label (the condition type's suffix). */}}
{{- define "ome-gateway-publisher.region" -}}
{{- if and .Values.region .Values.instanceName (ne .Values.region .Values.instanceName) }}
{{- fail (printf "instanceName is the old key of region: %q contradicts region %q; drop instanceName" .Values.instanceName .Values.region) }}
{{- end }}
{{- $name := default .Release.Name (default .Values.instanceName .Values.region) }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $name) }}
{{- fail (printf "region: the release name %q is not a DNS label; set region" $name) }}
{{- end }}
{{- $name }}
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

{{/* The gateway container the adapter writes to, with its mode: "envoy-xds", "envoy-files",
"nginx-lua", "nginx-reload", or "" (httproute, json). */}}
{{- define "ome-gateway-publisher.gatewayMode" -}}
{{- $gateway := include "ome-gateway-publisher.gateway" . }}
{{- if eq $gateway "envoy" }}envoy-{{ .Values.adapter.envoy.mode }}
{{- else if eq $gateway "nginx" }}nginx-{{ .Values.adapter.nginx.mode }}
{{- end }}
{{- end }}

{{/* "true" when the sidecar writes files for the gateway (Envoy files mode, NGINX reload mode, the
JSON adapter) on the gateway-config volume; "" when it pushes (xDS, Lua) or writes to an API. */}}
{{- define "ome-gateway-publisher.writesFiles" -}}
{{- if or (has (include "ome-gateway-publisher.gatewayMode" .) (list "envoy-files" "nginx-reload")) (eq .Values.adapter.name "json") }}true{{ end }}
{{- end }}

{{/* The Secret with NGINX's control-listener secret (lua mode): the user's, or the chart's. */}}
{{- define "ome-gateway-publisher.nginxControlSecretName" -}}
{{- default (printf "%s-nginx-control" (include "ome-gateway-publisher.fullname" .)) .Values.adapter.nginx.controlSecret.name }}
{{- end }}

{{/* Where both containers mount that secret; the file is the Secret's key. */}}
{{- define "ome-gateway-publisher.nginxSecretFile" -}}
/etc/ome-publisher/nginx-control/{{ .Values.adapter.nginx.controlSecret.key }}
{{- end }}

{{/* TrafficMaps and InferenceServices read, and this instance's status condition written. */}}
{{- define "ome-gateway-publisher.sourceRules" -}}
{{- $status := include "ome-gateway-publisher.statusMode" . -}}
- apiGroups: ["ome.io"]
  resources: ["trafficmaps", "inferenceservices"]
  verbs: ["get", "list", "watch"]
{{- /* Each mode also removes what the region left in the other: its RegionReports, its condition. */}}
{{- if eq $status "condition" }}
- apiGroups: ["ome.io"]
  resources: ["trafficmaps/status"]
  verbs: ["patch"]
- apiGroups: ["gateway-publisher.ome.io"]
  resources: ["regionreports"]
  verbs: ["list", "delete"]
{{- else if eq $status "report" }}
- apiGroups: ["gateway-publisher.ome.io"]
  resources: ["regionreports"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["ome.io"]
  resources: ["trafficmaps/status"]
  verbs: ["patch"]
{{- end }}
{{- end }}

{{/* condition | report | off: reportStatus false is off, whatever statusMode says. */}}
{{- define "ome-gateway-publisher.statusMode" -}}
{{- if .Values.reportStatus }}{{ .Values.statusMode }}{{ else }}off{{ end }}
{{- end }}

{{/* An image reference from an image value: by digest when one is given (immutable; the tag is
then only for people), else by tag. The context is (list <image> <default tag>). */}}
{{- define "ome-gateway-publisher.imageRef" -}}
{{- $image := index . 0 }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default (index . 1) $image.tag) }}
{{- end }}
{{- end }}

{{- define "ome-gateway-publisher.image" -}}
{{- include "ome-gateway-publisher.imageRef" (list .Values.image .Chart.AppVersion) }}
{{- end }}

{{/* "true" in the controlPlane topology (publishers and Envoys in two Deployments), "" in the
sidecar one. */}}
{{- define "ome-gateway-publisher.controlPlaneTopology" -}}
{{- if eq .Values.topology "controlPlane" }}true{{ end }}
{{- end }}

{{/* "true" when the publisher runs `--leader-elect`: asked for, or the controlPlane topology,
whose replicas all serve xDS while only the Lease holder writes status. */}}
{{- define "ome-gateway-publisher.leaderElect" -}}
{{- if or .Values.leaderElection.enabled (include "ome-gateway-publisher.controlPlaneTopology" .) }}true{{ end }}
{{- end }}

{{/* The publisher pods' selector: in the controlPlane topology the Envoy pods share the
release's labels, so each side adds its component. */}}
{{- define "ome-gateway-publisher.publisherSelectorLabels" -}}
{{ include "ome-gateway-publisher.selectorLabels" . }}
{{- if include "ome-gateway-publisher.controlPlaneTopology" . }}
app.kubernetes.io/component: publisher
{{- end }}
{{- end }}

{{/* The gateway pods' selector (the pod itself in the sidecar topology). */}}
{{- define "ome-gateway-publisher.gatewaySelectorLabels" -}}
{{ include "ome-gateway-publisher.selectorLabels" . }}
{{- if include "ome-gateway-publisher.controlPlaneTopology" . }}
app.kubernetes.io/component: envoy
{{- end }}
{{- end }}

{{/* controlPlane topology: the Service the Envoys reach the publishers' xDS server through. */}}
{{- define "ome-gateway-publisher.xdsServiceName" -}}
{{- printf "%s-xds" (include "ome-gateway-publisher.fullname" .) }}
{{- end }}

{{- define "ome-gateway-publisher.xdsServiceHost" -}}
{{- printf "%s.%s.svc" (include "ome-gateway-publisher.xdsServiceName" .) .Release.Namespace }}
{{- end }}

{{/* "true" when xDS leaves the pod over mTLS: the controlPlane topology, unless tls.allowPlaintext. */}}
{{- define "ome-gateway-publisher.xdsTls" -}}
{{- if and (include "ome-gateway-publisher.controlPlaneTopology" .) (not .Values.tls.allowPlaintext) }}true{{ end }}
{{- end }}

{{/* The Secrets of each side's certificate: the user's, or the one cert-manager writes. */}}
{{- define "ome-gateway-publisher.xdsServerSecret" -}}
{{- default (printf "%s-xds-server-tls" (include "ome-gateway-publisher.fullname" .)) .Values.tls.server.secretName }}
{{- end }}

{{- define "ome-gateway-publisher.xdsClientSecret" -}}
{{- default (printf "%s-xds-client-tls" (include "ome-gateway-publisher.fullname" .)) .Values.tls.client.secretName }}
{{- end }}

{{/* Where each side mounts its Secret (cert-manager's layout: tls.crt, tls.key, ca.crt). */}}
{{- define "ome-gateway-publisher.xdsServerTlsDir" -}}
/etc/ome-publisher/xds-tls
{{- end }}

{{- define "ome-gateway-publisher.xdsClientTlsDir" -}}
/etc/ome-gateway/xds-tls
{{- end }}

{{/* The pod-level settings both controlPlane Deployments share with the sidecar topology's pod;
the context is (list <root> <selector labels of this pod>). The anti-affinity spreads each
Deployment's pods over nodes unless `affinity` replaces it. */}}
{{- define "ome-gateway-publisher.controlPlaneScheduling" -}}
{{- $root := index . 0 -}}
affinity:
  {{- if $root.Values.affinity }}
  {{- toYaml $root.Values.affinity | nindent 2 }}
  {{- else }}
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- index . 1 | nindent 14 }}
  {{- end }}
{{- with $root.Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $root.Values.podSecurityContext | nindent 2 }}
terminationGracePeriodSeconds: {{ $root.Values.terminationGracePeriodSeconds }}
{{- end }}
