{{/*
What values.schema.json cannot say, because a JSON schema cannot compare two values: the ports the
pod's containers bind (one network namespace) differ, the gateway's drain ends before the pod's
grace period, and each duration is within the range the sidecar takes (_limits.tpl, generated from
the sidecar's code). Included by deployment.yaml, so install, template and lint all stop on it.
*/}}
{{- define "ome-gateway-publisher.validate" -}}
{{- include "ome-gateway-publisher.validateDurations" . }}
{{- $reserved := include "ome-gateway-publisher.httprouteReservedInstance" . }}
{{- if and (eq .Values.adapter.name "httproute") (eq (include "ome-gateway-publisher.instanceName" .) $reserved) }}
{{- fail (printf "instanceName: %q would name the routes like OME's own `<isvc>-%s` ones, which the httproute adapter refuses; set another instanceName" $reserved $reserved) }}
{{- end }}
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

{{/*
Each duration value in the range of the option it feeds: the value (the schema has checked its
grammar, `1h30m`, `1.5s`, `500ms`) summed in seconds part by part, as the sidecar parses it.
*/}}
{{- define "ome-gateway-publisher.validateDurations" -}}
{{- $units := dict "h" 3600.0 "m" 60.0 "s" 1.0 "ms" 0.001 }}
{{- range (include "ome-gateway-publisher.durationLimits" . | fromJsonArray) }}
{{- $value := $.Values }}
{{- range (splitList "." .path) }}
{{- $value = index $value . }}
{{- end }}
{{- if not (eq (toString $value) "") }}
{{- $seconds := 0.0 }}
{{- range (regexFindAll "[0-9]+(\\.[0-9]+)?(ms|h|m|s)" (toString $value) -1) }}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" . }}
{{- $seconds = addf $seconds (mulf (float64 $number) (get $units (trimPrefix $number .))) }}
{{- end }}
{{- if and (eq $seconds 0.0) (not .zeroOk) }}
{{- fail (printf "%s: %s must be longer than zero (%s)" .path (toString $value) .flag) }}
{{- else if lt $seconds .least }}
{{- fail (printf "%s: %s is shorter than %s, the least %s takes%s" .path (toString $value) .leastText .flag (ternary (printf ": %s" .why) "" (ne .why ""))) }}
{{- else if gt $seconds .most }}
{{- fail (printf "%s: %s is longer than %s, the most %s takes" .path (toString $value) .mostText .flag) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
