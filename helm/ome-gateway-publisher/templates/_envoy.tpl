{{/*
The Envoy pod's containers, after their `- name:` line: the sidecar topology's pod and the
controlPlane topology's Envoy Deployment run the same two, the bootstrap pointing at the sidecar on
127.0.0.1 or at the publishers' Service over mTLS (_envoy-bootstrap-args.tpl).
*/}}

{{/* The initContainer that writes Envoy's bootstrap to the envoy-bootstrap volume. */}}
{{- define "ome-gateway-publisher.envoyBootstrapContainer" -}}
image: {{ include "ome-gateway-publisher.image" . | quote }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
command: ["/bin/sh", "-c", 'exec ome-publisher envoy-bootstrap "$@" > /etc/envoy-bootstrap/envoy.yaml', "envoy-bootstrap"]
args:
  {{- include "ome-gateway-publisher.envoyBootstrapArgs" . | nindent 2 }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
volumeMounts:
  - {name: envoy-bootstrap, mountPath: /etc/envoy-bootstrap}
{{- if include "ome-gateway-publisher.xdsTls" . }}
  - {name: xds-tls, mountPath: {{ include "ome-gateway-publisher.xdsClientTlsDir" . }}, readOnly: true}
{{- end }}
{{- end }}

{{- define "ome-gateway-publisher.envoyContainer" -}}
{{- $controlPlane := include "ome-gateway-publisher.controlPlaneTopology" . -}}
image: {{ include "ome-gateway-publisher.imageRef" (list .Values.gateway.envoy.image "") | quote }}
imagePullPolicy: {{ .Values.gateway.envoy.image.pullPolicy }}
command: ["envoy"]
# A drain (the pre-stop hook's) closes each connection after its current request at once:
# the pod is going away, so clients should move to another now, not gradually.
args: ["-c", "/etc/envoy-bootstrap/envoy.yaml", "--drain-time-s", "{{ .Values.gateway.drain.timeoutSeconds }}", "--drain-strategy", "immediate"{{ if $controlPlane }}, "--service-node", "$(POD_NAME)"{{ end }}]
{{- if $controlPlane }}
# Each Envoy is named by its pod (node id) to the publishers: their per-Envoy metrics and /debug/maps.
env:
  - name: POD_NAME
    valueFrom:
      fieldRef: {fieldPath: metadata.name}
{{- end }}
{{- include "ome-gateway-publisher.gatewayCommon" . | nindent 0 }}
resources:
  {{- toYaml .Values.gateway.envoy.resources | nindent 2 }}
volumeMounts:
  - {name: tmp-gateway, mountPath: /tmp}
  - {name: envoy-bootstrap, mountPath: /etc/envoy-bootstrap, readOnly: true}
  {{- if eq (include "ome-gateway-publisher.gatewayMode" .) "envoy-files" }}
  - {name: gateway-config, mountPath: /run/ome-gateway, readOnly: true}
  {{- end }}
  {{- if include "ome-gateway-publisher.xdsTls" . }}
  - {name: xds-tls, mountPath: {{ include "ome-gateway-publisher.xdsClientTlsDir" . }}, readOnly: true}
  {{- end }}
  {{- with .Values.gateway.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
