{{/*
The arguments of `ome-publisher envoy-bootstrap`, run by the envoy-bootstrap initContainer.
xds mode points Envoy at the sidecar's xDS server (the controlPlane topology: at the publishers'
Service, over mTLS); files mode at the files the sidecar writes
(--envoy-dir, the mounts in deployment.yaml) and its Load Reporting Service (--lrs). Either way
Envoy reports its requests to the sidecar only while splitVerify is on. tests/test_helm.py checks every flag here against
`ome-publisher envoy-bootstrap --help`.
*/}}
{{- define "ome-gateway-publisher.envoyBootstrapArgs" -}}
{{- if eq .Values.adapter.envoy.mode "xds" }}
{{- if include "ome-gateway-publisher.controlPlaneTopology" . }}
- {{ printf "--xds=%s:%d" (include "ome-gateway-publisher.xdsServiceHost" .) (int .Values.adapter.envoy.xdsPort) | quote }}
{{- if include "ome-gateway-publisher.xdsTls" . }}
{{- $dir := include "ome-gateway-publisher.xdsClientTlsDir" . }}
- {{ printf "--tls-cert=%s/tls.crt" $dir | quote }}
- {{ printf "--tls-key=%s/tls.key" $dir | quote }}
- {{ printf "--tls-ca=%s/ca.crt" $dir | quote }}
- {{ printf "--tls-server-name=%s" (default (include "ome-gateway-publisher.xdsServiceHost" .) .Values.tls.serverName) | quote }}
{{- end }}
{{- else }}
- {{ printf "--xds=127.0.0.1:%d" (int .Values.adapter.envoy.xdsPort) | quote }}
{{- end }}
{{- if .Values.adapter.envoy.backendStats }}
- --backend-stats
{{- end }}
{{- else }}
- --envoy-dir=/run/ome-gateway
- {{ printf "--envoy-route-config=%s" .Values.adapter.envoy.routeConfig | quote }}
- {{ printf "--lrs=127.0.0.1:%d" (int .Values.adapter.envoy.lrsPort) | quote }}
{{- end }}
{{- if not .Values.splitVerify.enabled }}
- --no-load-stats
{{- end }}
- {{ printf "--listen=0.0.0.0:%d" (int .Values.gateway.port) | quote }}
- {{ printf "--admin=127.0.0.1:%d" (int .Values.gateway.envoy.adminPort) | quote }}
{{- end }}
