{{/*
Names, labels and the pieces every Argus pod shares. Components: router, allocator, worker,
controlnet, qdrant. Objects are named "<fullname>-<component>".
*/}}

{{- define "argus.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "argus.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* "<fullname>-<component>"; call with (dict "ctx" $ "component" "router") */}}
{{- define "argus.componentName" -}}
{{- printf "%s-%s" (include "argus.fullname" .ctx) .component }}
{{- end }}

{{- define "argus.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of this release's pods, whatever the component: NetworkPolicies select by these. */}}
{{- define "argus.releaseSelectorLabels" -}}
app.kubernetes.io/name: {{ include "argus.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* (dict "ctx" $ "component" "router") */}}
{{- define "argus.selectorLabels" -}}
{{ include "argus.releaseSelectorLabels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* (dict "ctx" $ "component" "router") */}}
{{- define "argus.labels" -}}
helm.sh/chart: {{ include "argus.chart" .ctx }}
{{ include "argus.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: argus
{{- with .ctx.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "argus.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "argus.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "argus.image" -}}
{{- $img := .Values.image }}
{{- if $img.digest }}
{{- printf "%s@%s" $img.repository $img.digest }}
{{- else }}
{{- printf "%s:%s" $img.repository (default .Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{/* Addresses the services reach each other at. */}}
{{- define "argus.allocatorAddress" -}}
{{- printf "%s:%d" (include "argus.componentName" (dict "ctx" . "component" "allocator")) (int .Values.allocator.port) }}
{{- end }}

{{- define "argus.controlnetAddress" -}}
{{- printf "%s:%d" (include "argus.componentName" (dict "ctx" . "component" "controlnet")) (int .Values.controlnet.port) }}
{{- end }}

{{- define "argus.qdrantUrl" -}}
{{- if .Values.qdrant.external.url }}
{{- .Values.qdrant.external.url }}
{{- else }}
{{- printf "http://%s:6333" (include "argus.componentName" (dict "ctx" . "component" "qdrant")) }}
{{- end }}
{{- end }}

{{- define "argus.latentStoreClaim" -}}
{{- default (include "argus.componentName" (dict "ctx" . "component" "latents")) .Values.latentStore.existingClaim }}
{{- end }}

{{- define "argus.authSecretName" -}}
{{- default (include "argus.componentName" (dict "ctx" . "component" "auth")) .Values.auth.existingSecret }}
{{- end }}

{{- define "argus.authSecretKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretKey }}{{ else }}token{{ end }}
{{- end }}

{{- define "argus.tlsSecretName" -}}
{{- default (include "argus.componentName" (dict "ctx" . "component" "tls")) .Values.tls.existingSecret }}
{{- end }}

{{- define "argus.profileConfigMap" -}}
{{- default (include "argus.componentName" (dict "ctx" . "component" "profile")) .Values.profile.existingConfigMap }}
{{- end }}

{{- define "argus.hasProfile" -}}
{{- if or .Values.profile.toml .Values.profile.existingConfigMap }}true{{ end }}
{{- end }}

{{/* Arguments every Argus service takes: bind address, ports, profile (not the ControlNet
service, which has none). The allocator, workers and the ControlNet service serve /metrics on
--host; the router on its own --metrics-host (loopback by default), hence "metricsHost".
(dict "ctx" $ "port" N ["noProfile" true] ["metricsHost" true]) */}}
{{- define "argus.commonArgs" -}}
- --host
- 0.0.0.0
- --port
- {{ int .port | quote }}
{{- if .ctx.Values.metrics.enabled }}
- --metrics-port
- {{ int .ctx.Values.metrics.port | quote }}
{{- if .metricsHost }}
- --metrics-host
- 0.0.0.0
{{- end }}
{{- end }}
{{- if and (include "argus.hasProfile" .ctx) (not .noProfile) }}
- --profile
- /etc/argus/profile/profile.toml
{{- end }}
{{- end }}

{{/* Environment of every Argus container: its identity (downward API) and writable caches. */}}
{{- define "argus.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /var/cache/argus
- name: HF_HOME
  value: /var/cache/argus/huggingface
- name: HF_HUB_OFFLINE
  value: "1"
- name: TORCH_HOME
  value: /var/cache/argus/torch
- name: TRITON_CACHE_DIR
  value: /var/cache/argus/triton
- name: MPLCONFIGDIR
  value: /var/cache/argus/matplotlib
- name: PYTHONUNBUFFERED
  value: "1"
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
{{- end }}

{{- define "argus.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /var/cache/argus
{{- if include "argus.hasProfile" . }}
- name: profile
  mountPath: /etc/argus/profile
  readOnly: true
{{- end }}
{{- end }}

{{- define "argus.scratchVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.scratch.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.scratch.cacheSizeLimit }}
{{- if include "argus.hasProfile" . }}
- name: profile
  configMap:
    name: {{ include "argus.profileConfigMap" . }}
    items:
      - key: profile.toml
        path: profile.toml
{{- end }}
{{- end }}

{{/* gRPC health probes on the gRPC port of an internal service. Its port takes only clients
with a certificate of the cluster CA, which a kubelet gRPC probe has not: the probe runs
`argus health` in the container (an exec probe) with the pod's own certificate. With
internalTls.enabled false the port is plaintext and the kubelet's gRPC probe asks directly.
(dict "ctx" $ "port" N "startupSeconds" N "role" "worker") */}}
{{- define "argus.grpcProbes" -}}
{{- $p := .ctx.Values.probes }}
{{- $check := include "argus.healthCheck" . }}
startupProbe:
  {{- $check | nindent 2 }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ max 1 (div (int .startupSeconds) (int $p.periodSeconds)) }}
livenessProbe:
  {{- $check | nindent 2 }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
readinessProbe:
  {{- $check | nindent 2 }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
{{- end }}

{{- define "argus.healthCheck" -}}
{{- if .ctx.Values.internalTls.enabled }}
exec:
  command:
    - argus
    - health
    - --address
    - 127.0.0.1:{{ .port }}
    - --service
    - {{ .ctx.Values.probes.service | quote }}
    - --internal-tls-dir
    - {{ include "argus.internalTlsDir" . }}
    - --role
    - {{ .role }}
{{- else }}
grpc:
  port: {{ .port }}
  service: {{ .ctx.Values.probes.service | quote }}
{{- end }}
{{- end }}

{{/* The router's probes. A router reports NOT_SERVING (every health service name) until its
first plan arrives from the allocator; restarting it would not bring the plan sooner, so the
startup and liveness probes only ask that the gRPC port accepts connections (the router opens
it once its profile and classifier are loaded). Readiness is the gRPC health check: no traffic
before a plan. Kubelet gRPC probes speak plaintext only (the API's grpc.mode: TLS comes after
1.36), so with TLS on the public port readiness falls back to TCP as well. (dict "ctx" $ "port" N "startupSeconds" N) */}}
{{- define "argus.routerProbes" -}}
{{- $p := .ctx.Values.probes }}
{{- $http := .ctx.Values.router.http }}
{{- $scheme := ternary "HTTPS" "HTTP" .ctx.Values.tls.enabled }}
startupProbe:
  tcpSocket:
    port: {{ .port }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ max 1 (div (int .startupSeconds) (int $p.periodSeconds)) }}
livenessProbe:
  {{- if $http.enabled }}
  httpGet:
    path: /healthz
    port: http
    scheme: {{ $scheme }}
  {{- else }}
  tcpSocket:
    port: {{ .port }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.livenessFailureThreshold }}
readinessProbe:
  {{- if $http.enabled }}
  httpGet:
    path: /readyz
    port: http
    scheme: {{ $scheme }}
  {{- else if .ctx.Values.tls.enabled }}
  tcpSocket:
    port: {{ .port }}
  {{- else }}
  grpc:
    port: {{ .port }}
    service: {{ $p.service | quote }}
  {{- end }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.readinessFailureThreshold }}
{{- end }}

{{/* Container ports: grpc and, when on, metrics. (dict "ctx" $ "port" N) */}}
{{- define "argus.containerPorts" -}}
- name: grpc
  containerPort: {{ .port }}
  protocol: TCP
{{- if .ctx.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .ctx.Values.metrics.port }}
  protocol: TCP
{{- end }}
{{- end }}

{{/* Service ports: grpc and, when on, metrics. (dict "ctx" $ "port" N) */}}
{{- define "argus.servicePorts" -}}
- name: grpc
  port: {{ .port }}
  targetPort: grpc
  protocol: TCP
  appProtocol: grpc
{{- if .ctx.Values.metrics.enabled }}
- name: metrics
  port: {{ .ctx.Values.metrics.port }}
  targetPort: metrics
  protocol: TCP
  appProtocol: http
{{- end }}
{{- end }}

{{/* Pod annotations: Prometheus scraping, config checksums, the component's own. (dict "ctx" $ "extra" map) */}}
{{- define "argus.podAnnotations" -}}
{{- $a := dict }}
{{- if and .ctx.Values.metrics.enabled .ctx.Values.metrics.podAnnotations }}
{{- $_ := set $a "prometheus.io/scrape" "true" }}
{{- $_ := set $a "prometheus.io/port" (toString .ctx.Values.metrics.port) }}
{{- $_ := set $a "prometheus.io/path" "/metrics" }}
{{- end }}
{{- if .ctx.Values.profile.toml }}
{{- $_ := set $a "checksum/profile" (.ctx.Values.profile.toml | sha256sum) }}
{{- end }}
{{- $a = merge (deepCopy (default dict .extra)) $a }}
{{- if $a }}
{{- toYaml $a }}
{{- end }}
{{- end }}

{{/* Resources with the GPU limit added. (dict "resources" map "gpu" map) */}}
{{- define "argus.gpuResources" -}}
{{- $res := deepCopy (default dict .resources) }}
{{- if gt (int .gpu.count) 0 }}
{{- $limits := default dict $res.limits }}
{{- $_ := set $limits .gpu.resourceName (int .gpu.count) }}
{{- $_ := set $res "limits" $limits }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Pod-level settings shared by every Argus pod. */}}
{{- define "argus.podCommon" -}}
serviceAccountName: {{ include "argus.serviceAccountName" . }}
automountServiceAccountToken: false
enableServiceLinks: false
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- end }}

{{/* Scheduling settings of a component. (dict "c" .Values.router) */}}
{{- define "argus.scheduling" -}}
{{- with .c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The internal plane's mutual TLS (argus/plumbing/internal_tls.py). An init container issues this pod's
certificate (argus://ROLE/POD_NAME) from the cluster CA, which comes from the Secret
internalTls.secretName (keys ca.crt, ca.key) and is mounted in the init container only, into an
in-memory emptyDir; the serving container mounts that emptyDir read-only: ca.crt, ROLE.crt,
ROLE.key, never the CA key. Off (internalTls.enabled false): --insecure-internal, loudly.
(dict "ctx" $ "role" "worker") */}}
{{- define "argus.internalTlsInit" -}}
{{- if .ctx.Values.internalTls.enabled }}
initContainers:
  - name: issue-cert
    image: {{ include "argus.image" .ctx }}
    imagePullPolicy: {{ .ctx.Values.image.pullPolicy }}
    command: ["argus"]
    args:
      - issue-cert
      - --ca-dir
      - /etc/argus/internal-ca
      - --identity
      - {{ .role }}/$(POD_NAME)
      - --out
      - {{ include "argus.internalTlsDir" . }}
    env:
      - name: POD_NAME
        valueFrom:
          fieldRef:
            fieldPath: metadata.name
      - name: HOME
        value: /tmp
      - name: PYTHONDONTWRITEBYTECODE
        value: "1"
    resources:
      {{- toYaml .ctx.Values.internalTls.initResources | nindent 6 }}
    securityContext:
      {{- toYaml .ctx.Values.containerSecurityContext | nindent 6 }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      - name: internal-ca
        mountPath: /etc/argus/internal-ca
        readOnly: true
      - name: internal-tls
        mountPath: {{ include "argus.internalTlsDir" . }}
{{- end }}
{{- end }}

{{- define "argus.internalTlsDir" -}}
/etc/argus/internal-tls
{{- end }}

{{/* The serving container's flag for the internal plane. (dict "ctx" $) */}}
{{- define "argus.internalTlsArgs" -}}
{{- if .ctx.Values.internalTls.enabled }}
- --internal-tls-dir
- {{ include "argus.internalTlsDir" . }}
{{- else }}
- --insecure-internal
{{- end }}
{{- end }}

{{- define "argus.internalTlsMounts" -}}
{{- if .ctx.Values.internalTls.enabled }}
- name: internal-tls
  mountPath: {{ include "argus.internalTlsDir" . }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "argus.internalTlsVolumes" -}}
{{- if .ctx.Values.internalTls.enabled }}
- name: internal-ca
  secret:
    secretName: {{ required "internalTls.secretName: the Secret holding the cluster CA (ca.crt, ca.key); see helm/README.md" .ctx.Values.internalTls.secretName }}
    defaultMode: 0440
    items:
      - key: ca.crt
        path: ca.crt
      - key: ca.key
        path: ca.key
- name: internal-tls
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
{{- end }}
{{- end }}
