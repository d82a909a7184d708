{{/*
The publisher container. With a gateway beside it (envoy, nginx) deployment.yaml makes it a native
sidecar (an initContainer with restartPolicy: Always), so the gateway starts after its startupProbe
passes; otherwise (httproute, json) it is the pod's only container.
*/}}
{{- define "ome-gateway-publisher.sidecar" -}}
name: publisher
image: {{ include "ome-gateway-publisher.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args:
{{- include "ome-gateway-publisher.runArgs" . | nindent 2 }}
ports:
  - name: metrics
    containerPort: {{ .Values.metrics.port }}
    protocol: TCP
{{- /* The gateway starts only once this passes (a native sidecar's startupProbe). */}}
startupProbe:
  httpGet: {path: /healthz, port: metrics}
  periodSeconds: 2
  failureThreshold: 30
livenessProbe:
  httpGet: {path: /healthz, port: metrics}
  periodSeconds: 10
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /readyz, port: metrics}
  periodSeconds: 5
  failureThreshold: 3
resources:
  {{- toYaml .Values.resources | nindent 2 }}
securityContext:
  {{- include "ome-gateway-publisher.containerSecurityContext" . | nindent 2 }}
volumeMounts:
  - {name: tmp-publisher, mountPath: /tmp}
  - {name: gateway-config, mountPath: /run/ome-gateway}
{{- if not .Values.controlPlane.inCluster }}
  - {name: control-plane-kubeconfig, mountPath: /etc/ome-publisher/control-plane, readOnly: true}
{{- end }}
{{- if and (eq .Values.adapter.name "httproute") .Values.adapter.httproute.gatewayKubeconfigSecret.name }}
  - {name: gateway-cluster-kubeconfig, mountPath: /etc/ome-publisher/gateway-cluster, readOnly: true}
{{- end }}
{{- if eq (include "ome-gateway-publisher.gateway" .) "nginx" }}
  - {name: nginx-run, mountPath: /run/nginx, readOnly: true}
{{- end }}
{{- end }}
