{{/*
The gateway container's pieces shared by both gateways: probes, the pre-stop drain, mounts.
*/}}

{{/*
Pre-stop drain. The kubelet runs it, then sends SIGTERM, on which Envoy exits at once and NGINX
cuts its streams, so the waiting happens here. Both wait a few seconds first, while the Service's
endpoints drop the pod, so no new request meets a closed listener.
- Envoy: /drain_listeners?graceful (with --drain-strategy immediate every connection is closed after
  its current request; listeners stay open through the drain period), then wait until no downstream
  request is active (the admin's own excluded) or the timeout. bash's /dev/tcp, because the Envoy
  image has no HTTP client; HTTP/1.1, because Envoy refuses HTTP/1.0.
- NGINX: `nginx -s quit` (graceful: old workers finish their requests, bounded by
  worker_shutdown_timeout, which the chart sets to the same timeout), then wait for the master to exit.
*/}}
{{- define "ome-gateway-publisher.gatewayPreStop" -}}
{{- $gateway := include "ome-gateway-publisher.gateway" . }}
{{- $timeout := int .Values.gateway.drain.timeoutSeconds }}
{{- $settle := min 5 $timeout }}
{{- if eq $gateway "envoy" }}
{{- $script := printf `admin() { exec 3<>/dev/tcp/127.0.0.1/%d || return 1; printf '%%s %%s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' "$1" "$2" >&3; cat <&3; exec 3<&-; }
sleep %d
admin POST '/drain_listeners?graceful' >/dev/null
end=$((SECONDS + %d))
while [ "$SECONDS" -lt "$end" ]; do
  active=$(admin GET '/stats?filter=downstream_rq_active$' | awk -F': ' '$1 !~ /^http[.]admin[.]/ && /downstream_rq_active/ {n += $2} END {print n + 0}')
  [ "$active" -eq 0 ] && exit 0
  sleep 1
done` (int .Values.gateway.envoy.adminPort) $settle (sub $timeout $settle) }}
exec:
  command:
    - /bin/bash
    - -c
    - |
      {{- $script | nindent 6 }}
{{- else }}
{{- $script := printf `sleep %d
nginx -c /etc/nginx/ome/nginx.conf -s quit
while [ -e /run/nginx/nginx.pid ]; do sleep 1; done` $settle }}
exec:
  command:
    - /bin/sh
    - -c
    - |
      {{- $script | nindent 6 }}
{{- end }}
{{- end }}

{{/* probes, lifecycle, securityContext and the extra mounts; the caller adds its own mounts after. */}}
{{- define "ome-gateway-publisher.gatewayCommon" -}}
ports:
  - {name: http, containerPort: {{ .Values.gateway.port }}, protocol: TCP}
{{- with .Values.gateway.probes.readiness }}
readinessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.gateway.probes.liveness }}
livenessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.gateway.drain.enabled }}
lifecycle:
  preStop:
    {{- include "ome-gateway-publisher.gatewayPreStop" . | nindent 4 }}
{{- end }}
securityContext:
  {{- toYaml .Values.gateway.securityContext | nindent 2 }}
{{- end }}
