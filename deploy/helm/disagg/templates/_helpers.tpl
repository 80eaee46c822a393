{{/* Names: <release>-disagg unless the release name already says disagg. */}}
{{- define "disagg.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "disagg.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "disagg.labels" -}}
{{ include "disagg.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "disagg.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "disagg.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The DNS name of a worker pool's headless Service: what the router resolves. */}}
{{- define "disagg.poolHost" -}}
{{- printf "%s-%s.%s.svc.%s" (include "disagg.fullname" .root) .role .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{/* Environment every part reads through the image's entrypoint (deploy/images/entrypoint.sh). */}}
{{- define "disagg.env" -}}
{{- $v := .root.Values -}}
- name: DISAGG_ROLE
  value: {{ .role }}
- name: DISAGG_PORT
  value: {{ .values.port | quote }}
- name: DISAGG_METRICS_PORT
  value: {{ .values.metricsPort | quote }}
- name: DISAGG_GRACE_SECONDS
  value: {{ $v.graceSeconds | quote }}
- name: DISAGG_LOG_LEVEL
  value: {{ $v.logLevel | quote }}
{{- if $v.model.path }}
- name: DISAGG_MODEL
  value: {{ $v.model.path | quote }}
{{- end }}
{{- if $v.tls.enabled }}
- name: DISAGG_TLS_DIR
  value: /etc/disagg/tls
- name: DISAGG_TLS_SERVER_NAME
  value: {{ $v.tls.serverName | quote }}
{{- end }}
{{- with .values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Probes on grpc.health.v1: "" is SERVING once the model is loaded and until
the drain starts (readiness); "liveness" is SERVING while the process runs.
The kubelet's own gRPC probe speaks plaintext only, so with TLS on the port the
image's entrypoint runs the check (python -m disagg.rpc.healthcheck). */}}
{{- define "disagg.probes" -}}
{{- $tls := .tls -}}
{{- range $kind := list "startupProbe" "readinessProbe" "livenessProbe" }}
{{ $kind }}:
  {{- $service := ternary "" "liveness" (eq $kind "readinessProbe") }}
  {{- if $tls }}
  exec:
    command: ["/opt/disagg/entrypoint.sh", "probe"{{ if $service }}, "--service", {{ $service | quote }}{{ end }}]
  {{- else }}
  grpc:
    port: {{ $.port }}
    {{- if $service }}
    service: {{ $service }}
    {{- end }}
  {{- end }}
  {{- if eq $kind "startupProbe" }}
  periodSeconds: 2
  failureThreshold: {{ max 1 (div $.startupSeconds 2) }}
  {{- else }}
  periodSeconds: {{ ternary 5 10 (eq $kind "readinessProbe") }}
  timeoutSeconds: 5
  failureThreshold: {{ ternary 1 3 (eq $kind "readinessProbe") }}
  {{- end }}
{{- end }}
{{- end -}}

{{/* Drain: a removed pod keeps serving for preStopSeconds, then gets SIGTERM
and graceSeconds for its calls in flight; the kubelet waits for both. */}}
{{- define "disagg.drain" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .Values.preStopSeconds | quote }}]
{{- end -}}

{{- define "disagg.terminationGrace" -}}
{{- add .Values.preStopSeconds .Values.graceSeconds 5 -}}
{{- end -}}

{{/* Volumes shared by every pod: the model, writable scratch for a read-only root, the TLS Secret. */}}
{{- define "disagg.volumes" -}}
- name: cache
  emptyDir: {}
- name: tmp
  emptyDir: {}
{{- with .Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "disagg.volumeMounts" -}}
- name: cache
  mountPath: /home/disagg/.cache
- name: tmp
  mountPath: /tmp
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/disagg/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "disagg.modelInit" -}}
{{- with .Values.model.init }}
initContainers:
  - name: fetch-model
    image: {{ .image }}
    {{- with .command }}
    command: {{ toJson . }}
    {{- end }}
    {{- with .args }}
    args: {{ toJson . }}
    {{- end }}
    {{- with .env }}
    env: {{ toYaml . | nindent 6 }}
    {{- end }}
    volumeMounts:
      - name: model
        mountPath: {{ $.Values.model.mountPath }}
      - name: tmp
        mountPath: /tmp
{{- end }}
{{- end -}}
