{{/*
The arguments of `ome-publisher run` (the image's ENTRYPOINT), one per list item, then extraArgs.
Paths name the pod's mounts (see deployment.yaml). tests/test_helm.py checks every flag here
against `ome-publisher run --help`.
*/}}
{{- define "ome-gateway-publisher.runArgs" -}}
{{- $mode := include "ome-gateway-publisher.gatewayMode" . -}}
- run
- {{ printf "--region=%s" (include "ome-gateway-publisher.region" .) | quote }}
- --source=kube
{{- if not .Values.controlPlane.inCluster }}
- --kubeconfig=/etc/ome-publisher/control-plane/kubeconfig
{{- end }}
{{- range .Values.watch.namespaces }}
- {{ printf "--namespace=%s" . | quote }}
{{- end }}
{{- with .Values.watch.labelSelector }}
- {{ printf "--label-selector=%s" . | quote }}
{{- end }}
- {{ printf "--resync=%s" .Values.watch.resync | quote }}
- {{ printf "--ome-published-gate=%s" .Values.gates.omePublishedGate | quote }}
{{- with .Values.gates.probeMaxAge }}
- {{ printf "--probe-max-age=%s" . | quote }}
{{- end }}
- {{ printf "--host-template=%s" .Values.hostTemplate | quote }}
- {{ printf "--split-verify=%s" (ternary "on" "off" .Values.splitVerify.enabled) | quote }}
- {{ printf "--split-interval=%s" .Values.splitVerify.interval | quote }}
- {{ printf "--status-mode=%s" (include "ome-gateway-publisher.statusMode" .) | quote }}
{{- if include "ome-gateway-publisher.leaderElect" . }}
- --leader-elect
- {{ printf "--lease-namespace=%s" (include "ome-gateway-publisher.leaseNamespace" .) | quote }}
{{- end }}
{{- with .Values.statusDelay }}
- {{ printf "--status-delay=%s" . | quote }}
{{- end }}
- {{ printf "--listen=0.0.0.0:%d" (int .Values.metrics.port) | quote }}
- {{ printf "--metrics-per-map=%s" .Values.metrics.perMap | quote }}
- {{ printf "--log-format=%s" .Values.log.format | quote }}
- {{ printf "--log-level=%s" .Values.log.level | quote }}
- {{ printf "--adapter=%s" .Values.adapter.name | quote }}
{{- if eq .Values.adapter.name "envoy" }}
{{- if and (eq $mode "envoy-xds") (include "ome-gateway-publisher.controlPlaneTopology" .) }}
{{- /* The Envoys are in other pods: every address, over mTLS unless plaintext is asked for. They
reach a replica through the xDS Service, which lists only ready ones: a replica is ready once synced. */}}
- {{ printf "--envoy-xds-listen=0.0.0.0:%d" (int .Values.adapter.envoy.xdsPort) | quote }}
- --ready-without-gateway
{{- if include "ome-gateway-publisher.xdsTls" . }}
{{- $dir := include "ome-gateway-publisher.xdsServerTlsDir" . }}
- {{ printf "--envoy-xds-tls-cert=%s/tls.crt" $dir | quote }}
- {{ printf "--envoy-xds-tls-key=%s/tls.key" $dir | quote }}
- {{ printf "--envoy-xds-client-ca=%s/ca.crt" $dir | quote }}
{{- else }}
- --envoy-xds-allow-plaintext
{{- end }}
{{- else if eq $mode "envoy-xds" }}
- {{ printf "--envoy-xds-listen=127.0.0.1:%d" (int .Values.adapter.envoy.xdsPort) | quote }}
{{- else }}
- --envoy-dir=/run/ome-gateway
- {{ printf "--envoy-route-config=%s" .Values.adapter.envoy.routeConfig | quote }}
- {{ printf "--envoy-admin=http://127.0.0.1:%d" (int .Values.gateway.envoy.adminPort) | quote }}
{{- if .Values.splitVerify.enabled }}
- {{ printf "--envoy-lrs-listen=127.0.0.1:%d" (int .Values.adapter.envoy.lrsPort) | quote }}
{{- end }}
{{- end }}
{{- if .Values.adapter.envoy.rewriteHost }}
- --rewrite-host
{{- end }}
- {{ printf "--route-timeout=%s" .Values.routeTimeouts.total | quote }}
- {{ printf "--route-idle-timeout=%s" .Values.routeTimeouts.idle | quote }}
{{- else if eq .Values.adapter.name "nginx" }}
- {{ printf "--nginx-mode=%s" .Values.adapter.nginx.mode | quote }}
{{- if .Values.adapter.nginx.rewriteHost }}
- --rewrite-host
{{- end }}
{{- if eq $mode "nginx-lua" }}
- {{ printf "--nginx-control-url=http://127.0.0.1:%d" (int .Values.adapter.nginx.controlPort) | quote }}
- {{ printf "--nginx-secret-file=%s" (include "ome-gateway-publisher.nginxSecretFile" .) | quote }}
{{- else }}
- --nginx-conf-file=/run/ome-gateway/ome-gateway.conf
- {{ printf "--nginx-listen=%d" (int .Values.gateway.port) | quote }}
{{- if .Values.adapter.nginx.reloadCmd }}
- {{ printf "--nginx-reload-cmd=%s" .Values.adapter.nginx.reloadCmd | quote }}
{{- else }}
- --nginx-pid-file=/run/nginx/nginx.pid
{{- end }}
- {{ printf "--nginx-status-listen=%s" .Values.adapter.nginx.statusListen | quote }}
- {{ printf "--nginx-min-reload-interval=%s" .Values.adapter.nginx.minReloadInterval | quote }}
- {{ printf "--route-idle-timeout=%s" .Values.routeTimeouts.idle | quote }}
{{- with .Values.adapter.nginx.testCmd }}
- {{ printf "--nginx-test-cmd=%s" . | quote }}
{{- end }}
{{- end }}
{{- else if eq .Values.adapter.name "httproute" }}
- {{ printf "--gateway=%s" (required "adapter.httproute.gateway (NAMESPACE/NAME) is required for the httproute adapter" .Values.adapter.httproute.gateway) | quote }}
- {{ printf "--backend-port=%d" (int .Values.adapter.httproute.backendPort) | quote }}
- {{ printf "--route-namespace=%s" (include "ome-gateway-publisher.routeNamespace" .) | quote }}
- {{ printf "--route-timeout=%s" .Values.routeTimeouts.total | quote }}
{{- if .Values.adapter.httproute.gatewayKubeconfigSecret.name }}
- --gateway-kubeconfig=/etc/ome-publisher/gateway-cluster/kubeconfig
{{- end }}
{{- else if eq .Values.adapter.name "json" }}
- --json-dir=/run/ome-gateway/maps
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
