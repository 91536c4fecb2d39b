{{/* Names */}}
{{- define "bagpipe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "bagpipe.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "bagpipe.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "bagpipe.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<component>, e.g. bagpipe-trainer */}}
{{- define "bagpipe.component" -}}
{{- printf "%s-%s" (include "bagpipe.fullname" .root) .component -}}
{{- end -}}

{{- define "bagpipe.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "bagpipe.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: bagpipe
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "bagpipe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bagpipe.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels every Bagpipe pod of this release carries (NetworkPolicy peers) */}}
{{- define "bagpipe.memberLabels" -}}
app.kubernetes.io/name: {{ include "bagpipe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bagpipe.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "bagpipe.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image: <registry>/<repository>:<tag>[-cuda] */}}
{{- define "bagpipe.image" -}}
{{- $tag := .values.image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion -}}
{{- if eq (.values.image.variant | default "cpu") "cuda" }}{{ $tag = printf "%s-cuda" $tag }}{{ end -}}
{{- if .root.Values.image.registry -}}
{{- printf "%s/%s:%s" .root.Values.image.registry .values.image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" .values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "bagpipe.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:%d/0" (include "bagpipe.fullname" .) (int .Values.redis.port) -}}
{{- else if .Values.externalRedis.url -}}
{{- .Values.externalRedis.url -}}
{{- else -}}
{{- fail "redis.enabled is false: set externalRedis.url (redis://host:port/db)" -}}
{{- end -}}
{{- end -}}

{{/* The job's Redis and name: every service, and the embedding servers' drain hook */}}
{{- define "bagpipe.jobArgs" -}}
- --redis
- {{ include "bagpipe.redisUrl" . | quote }}
- --job
- {{ .Release.Name | quote }}
{{- end -}}

{{/* Flags every service takes: coordination and where it serves metrics */}}
{{- define "bagpipe.coordinationArgs" -}}
{{ include "bagpipe.jobArgs" . }}
- --log-level
- {{ .Values.training.logLevel | quote }}
- --metrics-address
- {{ printf "0.0.0.0:%d" (int .Values.ports.metrics) | quote }}
- --advertise-host
- $(POD_IP)
{{- end -}}

{{- define "bagpipe.tableArgs" -}}
- --data
- {{ .Values.training.data | quote }}
{{- if .Values.training.tableRows }}
- --table-rows
- {{ include "bagpipe.intList" .Values.training.tableRows | quote }}
{{- end }}
- --scale
- {{ .Values.training.scale | quote }}
{{- end -}}

{{- define "bagpipe.modelArgs" -}}
- --model
- {{ .Values.training.model | quote }}
- --embedding-dim
- {{ .Values.training.embeddingDim | int64 | quote }}
- --optimizer
- {{ .Values.training.optimizer | quote }}
- --lr
- {{ .Values.training.lr | quote }}
{{- if .Values.training.eps }}
- --eps
- {{ .Values.training.eps | quote }}
{{- end }}
- --seed
- {{ .Values.training.seed | int64 | quote }}
{{- if .Values.training.initFrom }}
- --init-from
- {{ printf "%s/%s" .Values.trainer.checkpoints.mountPath .Values.training.initFrom | quote }}
{{- end }}
{{- end -}}

{{- define "bagpipe.cacheArgs" -}}
{{- with .Values.training }}
{{- if .lookahead }}
- --lookahead
- {{ .lookahead | int64 | quote }}
{{- end }}
- --max-lookahead
- {{ .maxLookahead | int64 | quote }}
{{- if .cacheRows }}
- --cache-rows
- {{ .cacheRows | int64 | quote }}
{{- end }}
- --reuse-delay
- {{ .reuseDelay | int64 | quote }}
- --cache-mode
- {{ .cacheMode | quote }}
- --sync
- {{ .sync | quote }}
{{- end }}
{{- end -}}

{{/* The Secret with the job's secret and the bundled Redis's password: the chart's, or the user's */}}
{{- define "bagpipe.authSecretName" -}}
{{- if and .Values.auth.existingSecret .Values.auth.jobSecret -}}
{{- fail "set auth.jobSecret or auth.existingSecret, not both (the existing Secret holds the job's secret)" -}}
{{- end -}}
{{- .Values.auth.existingSecret | default (printf "%s-auth" (include "bagpipe.fullname" .)) -}}
{{- end -}}

{{/* Where the Redis password is: the auth Secret for the bundled Redis, externalRedis.passwordSecret for
     another one, nowhere when that is unset (an external Redis may have none) */}}
{{- define "bagpipe.redisPasswordRef" -}}
{{- if .Values.redis.enabled -}}
name: {{ include "bagpipe.authSecretName" . }}
key: redisPassword
{{- else -}}
{{- with .Values.externalRedis.passwordSecret -}}
{{- if and .name .key -}}
name: {{ .name }}
key: {{ .key }}
{{- else if or .name .key -}}
{{- fail "externalRedis.passwordSecret needs both name and key (or neither: a Redis without a password)" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Mutual TLS: the user's Secret (cert-manager's layout), mounted read-only in every Bagpipe container. Pods
     are dialled by IP, so clients check the servers' certificates for one name, tls.serverName. */}}
{{- define "bagpipe.tlsMountPath" -}}/etc/bagpipe/tls{{- end -}}

{{- define "bagpipe.tlsSecretName" -}}
{{- .Values.tls.secretName | required "tls.enabled is true: set tls.secretName, a Secret with keys tls.crt, tls.key and ca.crt (the job's CA)" -}}
{{- end -}}

{{/* The services read the files' paths from the env (as --tls-cert/--tls-key/--tls-ca would set them) */}}
{{- define "bagpipe.tlsEnv" -}}
{{- if .Values.tls.enabled }}
{{- $dir := include "bagpipe.tlsMountPath" . }}
- name: BAGPIPE_TLS_CERT
  value: {{ printf "%s/tls.crt" $dir | quote }}
- name: BAGPIPE_TLS_KEY
  value: {{ printf "%s/tls.key" $dir | quote }}
- name: BAGPIPE_TLS_CA
  value: {{ printf "%s/ca.crt" $dir | quote }}
- name: BAGPIPE_TLS_SERVER_NAME
  value: {{ .Values.tls.serverName | quote }}
{{- end }}
{{- end -}}

{{/* The Secret's volume and its mount (with TLS). The key is group-readable only, through the pods' fsGroup;
     listing the keys makes a Secret that lacks one fail at mount, in the pod's events. */}}
{{- define "bagpipe.tlsVolumeMount" -}}
- name: tls
  mountPath: {{ include "bagpipe.tlsMountPath" . }}
  readOnly: true
{{- end -}}

{{- define "bagpipe.tlsVolume" -}}
- name: tls
  secret:
    secretName: {{ include "bagpipe.tlsSecretName" . }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end -}}

{{/* Every Bagpipe container (services, drain hook, test probe) sends the job's secret with each gRPC call and
     gives Redis its password. Both come from a Secret into the env, never into args: flags show in /proc.
     With TLS, the certificate files' paths too. */}}
{{- define "bagpipe.authEnv" -}}
- name: BAGPIPE_JOB_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "bagpipe.authSecretName" . }}
      key: jobSecret
{{- with include "bagpipe.redisPasswordRef" . }}
- name: BAGPIPE_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      {{- . | nindent 6 }}
{{- end }}
{{- include "bagpipe.tlsEnv" . }}
{{- end -}}

{{/* env every container gets: its pod IP (advertised in Redis), in StatefulSets its ordinal, and the job's
     credentials (the preStop drain hook inherits them) */}}
{{- define "bagpipe.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- if .ordinal }}
- name: POD_INDEX
  valueFrom:
    fieldRef:
      fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
{{- end }}
{{ include "bagpipe.authEnv" .root }}
{{- with .values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The gRPC health check, or with TLS (kubelet's gRPC probes speak only plaintext) the service's /readyz,
     which answers 200 once it listens and is registered */}}
{{- define "bagpipe.readyCheck" -}}
{{- if .Values.tls.enabled -}}
httpGet:
  path: /readyz
  port: metrics
{{- else -}}
grpc:
  port: {{ .Values.ports.grpc }}
{{- end -}}
{{- end -}}

{{- define "bagpipe.grpcProbes" -}}
startupProbe:
  {{- include "bagpipe.readyCheck" .root | nindent 2 }}
  periodSeconds: {{ .values.probes.startup.periodSeconds }}
  failureThreshold: {{ .values.probes.startup.failureThreshold }}
readinessProbe:
  {{- include "bagpipe.readyCheck" .root | nindent 2 }}
  periodSeconds: {{ .values.probes.readiness.periodSeconds }}
  failureThreshold: {{ .values.probes.readiness.failureThreshold }}
livenessProbe:
  httpGet:
    path: /healthz
    port: metrics
  periodSeconds: {{ .values.probes.liveness.periodSeconds }}
  failureThreshold: {{ .values.probes.liveness.failureThreshold }}
{{- end -}}

{{- define "bagpipe.podCommon" -}}
serviceAccountName: {{ include "bagpipe.serviceAccountName" .root }}
automountServiceAccountToken: {{ .automount | default false }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{- define "bagpipe.pdb" -}}
{{- if .values.podDisruptionBudget.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "bagpipe.component" . }}
  labels:
    {{- include "bagpipe.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .values.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "bagpipe.selectorLabels" . | nindent 6 }}
{{- end }}
{{- end -}}

{{/* [1460, 10131227] -> "1460,10131227" (YAML numbers are floats to the template engine) */}}
{{- define "bagpipe.intList" -}}
{{- $out := list -}}
{{- range . }}{{ $out = append $out (int64 . | toString) }}{{ end -}}
{{- join "," $out -}}
{{- end -}}

{{/* Whether to render a Prometheus Operator object: "auto" when the cluster serves its CRDs
     (monitoring.coreos.com/v1), so installs work on clusters without the operator; true/false force it. */}}
{{- define "bagpipe.monitoring" -}}
{{- $root := index . 0 -}}
{{- $enabled := index . 1 -}}
{{- if eq (toString $enabled) "auto" -}}
{{- if $root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end -}}
{{- else if $enabled -}}
true
{{- end -}}
{{- end -}}
