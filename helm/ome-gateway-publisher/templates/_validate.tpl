{{/*
What values.schema.json cannot say, because a JSON schema cannot compare two values: the ports the
pod's containers bind (one network namespace) differ, the gateway's drain ends before the pod's
grace period, and each duration is within the range the sidecar takes (_limits.tpl, generated from
the sidecar's code). Included by deployment.yaml, so install, template and lint all stop on it.
*/}}
{{- define "ome-gateway-publisher.validate" -}}
{{- include "ome-gateway-publisher.validateDurations" . }}
{{- include "ome-gateway-publisher.validateControlPlaneTopology" . }}
{{- $reserved := include "ome-gateway-publisher.httprouteReservedInstance" . }}
{{- if and (eq .Values.adapter.name "httproute") (eq (include "ome-gateway-publisher.region" .) $reserved) }}
{{- fail (printf "region: %q would name the routes like OME's own `<isvc>-%s` ones, which the httproute adapter refuses; set another region" $reserved $reserved) }}
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

{{/*
The controlPlane topology serves Envoys in other pods over xDS, so it takes the envoy adapter in
xds mode only, and mTLS from somewhere (Secrets or cert-manager) unless plaintext is asked for.
*/}}
{{- define "ome-gateway-publisher.validateControlPlaneTopology" -}}
{{- if include "ome-gateway-publisher.controlPlaneTopology" . }}
{{- if ne .Values.adapter.name "envoy" }}
{{- fail (printf "topology: controlPlane serves Envoys in their own pods over xDS, so it needs adapter.name envoy (adapter.envoy.mode xds), not %q; use topology: sidecar for the %s adapter" .Values.adapter.name .Values.adapter.name) }}
{{- end }}
{{- if ne .Values.adapter.envoy.mode "xds" }}
{{- fail (printf "topology: controlPlane needs adapter.envoy.mode xds, not %q: in files mode Envoy reads files the publisher writes in its own pod; use topology: sidecar for files mode" .Values.adapter.envoy.mode) }}
{{- end }}
{{- if include "ome-gateway-publisher.xdsTls" . }}
{{- if .Values.tls.certManager.enabled }}
{{- if not .Values.tls.certManager.issuerRef.name }}
{{- fail "tls.certManager.enabled: set tls.certManager.issuerRef.name, the Issuer or ClusterIssuer that signs the xDS certificates" }}
{{- end }}
{{- else if not (and .Values.tls.server.secretName .Values.tls.client.secretName) }}
{{- fail "topology: controlPlane serves xDS off the pod over mTLS: set tls.server.secretName and tls.client.secretName (each with tls.crt, tls.key and ca.crt), or tls.certManager.enabled with tls.certManager.issuerRef.name; tls.allowPlaintext serves it without TLS, for a trusted network only" }}
{{- end }}
{{- end }}
{{- $autoscaling := .Values.controlPlaneTopology.envoy.autoscaling }}
{{- if and $autoscaling.enabled (gt (int $autoscaling.minReplicas) (int $autoscaling.maxReplicas)) }}
{{- fail (printf "controlPlaneTopology.envoy.autoscaling: minReplicas (%d) is more than maxReplicas (%d)" (int $autoscaling.minReplicas) (int $autoscaling.maxReplicas)) }}
{{- end }}
{{- if and $autoscaling.enabled (not (dig "requests" "cpu" "" (.Values.gateway.envoy.resources | default dict))) }}
{{- fail "controlPlaneTopology.envoy.autoscaling scales on CPU use in percent of the request: set gateway.envoy.resources.requests.cpu" }}
{{- end }}
{{- end }}
{{- end }}
