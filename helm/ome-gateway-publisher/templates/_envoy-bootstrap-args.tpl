{{/*
The arguments of `ome-publisher envoy-bootstrap`, run by the envoy-bootstrap initContainer.
The paths match the sidecar's --envoy-dir and the mounts in deployment.yaml. tests/test_helm.py
checks every flag here against `ome-publisher envoy-bootstrap --help`.
*/}}
{{- define "ome-gateway-publisher.envoyBootstrapArgs" -}}
- --envoy-dir=/run/ome-gateway
- {{ printf "--listen=0.0.0.0:%d" (int .Values.gateway.port) | quote }}
- {{ printf "--admin=127.0.0.1:%d" (int .Values.gateway.envoy.adminPort) | quote }}
- {{ printf "--envoy-route-config=%s" .Values.adapter.envoy.routeConfig | quote }}
{{- end }}
