{{/*
The arguments of `ome-publisher nginx-config` (lua mode), run by the nginx-config initContainer:
the http {} snippet NGINX includes. tests/test_helm.py checks every flag here against
`ome-publisher nginx-config --help`.
*/}}
{{- define "ome-gateway-publisher.nginxConfigArgs" -}}
- {{ printf "--listen=%d" (int .Values.gateway.port) | quote }}
- {{ printf "--control-listen=127.0.0.1:%d" (int .Values.adapter.nginx.controlPort) | quote }}
- {{ printf "--secret-file=%s" (include "ome-gateway-publisher.nginxSecretFile" .) | quote }}
- --lua-dir=/etc/nginx/ome-lua/lua
{{- with .Values.adapter.nginx.sharedDictSize }}
- {{ printf "--shared-dict-size=%s" . | quote }}
{{- end }}
{{- with .Values.adapter.nginx.countsDictSize }}
- {{ printf "--counts-dict-size=%s" . | quote }}
{{- end }}
{{- with .Values.adapter.nginx.caFile }}
- {{ printf "--ca-file=%s" . | quote }}
{{- end }}
- {{ printf "--route-idle-timeout=%s" .Values.routeTimeouts.idle | quote }}
{{- end }}
