{{/*
The arguments of `ome-publisher envoy-bootstrap`, run by the envoy-bootstrap initContainer.
xds mode points Envoy at the sidecar's xDS server; files mode at the files the sidecar writes
(--envoy-dir, the mounts in deployment.yaml) and its Load Reporting Service (--lrs). Either way
Envoy reports its requests to the sidecar only while splitVerify is on. tests/test_helm.py checks every flag here against
`ome-publisher envoy-bootstrap --help`.
*/}}
{{- define "ome-gateway-publisher.envoyBootstrapArgs" -}}
{{- if eq .Values.adapter.envoy.mode "xds" }}
- {{ printf "--xds=127.0.0.1:%d" (int .Values.adapter.envoy.xdsPort) | quote }}
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
