{{/*
The publisher container. With a gateway beside it (envoy, nginx) deployment.yaml makes it a native
sidecar (an initContainer with restartPolicy: Always), so the gateway starts after its startupProbe
passes and the sidecar stops only after the gateway has drained; otherwise (httproute, json) it is
the pod's only container, as it is in the controlPlane topology's publisher Deployment, where it
also serves xDS to the Envoys' pods (the xds port).
*/}}
{{- define "ome-gateway-publisher.sidecar" -}}
{{- $mode := include "ome-gateway-publisher.gatewayMode" . -}}
name: publisher
image: {{ include "ome-gateway-publisher.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args:
{{- include "ome-gateway-publisher.runArgs" . | nindent 2 }}
{{- with .Values.extraEnv }}
env:
  {{- toYaml . | nindent 2 }}
{{- end }}
ports:
  - name: metrics
    containerPort: {{ .Values.metrics.port }}
    protocol: TCP
{{- if include "ome-gateway-publisher.controlPlaneTopology" . }}
  - name: xds
    containerPort: {{ .Values.adapter.envoy.xdsPort }}
    protocol: TCP
{{- end }}
{{- with .Values.probes.startup }}
startupProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.probes.liveness }}
livenessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.probes.readiness }}
readinessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
resources:
  {{- toYaml .Values.resources | nindent 2 }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
volumeMounts:
  - {name: tmp-publisher, mountPath: /tmp}
{{- if include "ome-gateway-publisher.writesFiles" . }}
  - {name: gateway-config, mountPath: /run/ome-gateway}
{{- end }}
{{- if not .Values.controlPlane.inCluster }}
  - {name: control-plane-kubeconfig, mountPath: /etc/ome-publisher/control-plane, readOnly: true}
{{- end }}
{{- if and (eq .Values.adapter.name "httproute") .Values.adapter.httproute.gatewayKubeconfigSecret.name }}
  - {name: gateway-cluster-kubeconfig, mountPath: /etc/ome-publisher/gateway-cluster, readOnly: true}
{{- end }}
{{- if eq $mode "nginx-reload" }}
  - {name: nginx-run, mountPath: /run/nginx, readOnly: true}
{{- else if eq $mode "nginx-lua" }}
  - {name: nginx-control-secret, mountPath: /etc/ome-publisher/nginx-control, readOnly: true}
{{- end }}
{{- if include "ome-gateway-publisher.xdsTls" . }}
  - {name: xds-tls, mountPath: {{ include "ome-gateway-publisher.xdsServerTlsDir" . }}, readOnly: true}
{{- end }}
{{- with .Values.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
