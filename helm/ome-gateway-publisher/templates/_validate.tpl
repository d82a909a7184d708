{{/*
What values.schema.json cannot say, because a JSON schema cannot compare two values: the ports the
pod's containers bind (one network namespace) differ, and the gateway's drain ends before the pod's
grace period. Included by deployment.yaml, so install, template and lint all stop on it.
*/}}
{{- define "ome-gateway-publisher.validate" -}}
{{- $ports := dict (printf "%d" (int .Values.metrics.port)) "metrics.port" }}
{{- $mode := include "ome-gateway-publisher.gatewayMode" . }}
{{- $bound := list }}
{{- if $mode }}
{{- $bound = append $bound (list "gateway.port" .Values.gateway.port) }}
{{- end }}
{{- if hasPrefix "envoy" $mode }}
{{- $bound = append $bound (list "gateway.envoy.adminPort" .Values.gateway.envoy.adminPort) }}
{{- end }}
{{- if eq $mode "envoy-xds" }}
{{- $bound = append $bound (list "adapter.envoy.xdsPort" .Values.adapter.envoy.xdsPort) }}
{{- else if and (eq $mode "envoy-files") .Values.splitVerify.enabled }}
{{- $bound = append $bound (list "adapter.envoy.lrsPort" .Values.adapter.envoy.lrsPort) }}
{{- else if eq $mode "nginx-lua" }}
{{- $bound = append $bound (list "adapter.nginx.controlPort" .Values.adapter.nginx.controlPort) }}
{{- else if eq $mode "nginx-reload" }}
{{- $bound = append $bound (list "adapter.nginx.statusListen" (last (splitList ":" .Values.adapter.nginx.statusListen))) }}
{{- end }}
{{- range $bound }}
{{- $port := printf "%d" (int (index . 1)) }}
{{- if hasKey $ports $port }}
{{- fail (printf "%s and %s are both port %s: the pod's containers share one network namespace" (get $ports $port) (index . 0) $port) }}
{{- end }}
{{- $_ := set $ports $port (index . 0) }}
{{- end }}
{{- if and $mode .Values.gateway.drain.enabled (ge (int .Values.gateway.drain.timeoutSeconds) (int .Values.terminationGracePeriodSeconds)) }}
{{- fail (printf "gateway.drain.timeoutSeconds (%d) must be shorter than terminationGracePeriodSeconds (%d), or the kubelet kills the gateway mid-drain" (int .Values.gateway.drain.timeoutSeconds) (int .Values.terminationGracePeriodSeconds)) }}
{{- end }}
{{- end }}
