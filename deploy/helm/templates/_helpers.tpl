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

{{/* The one image: <registry>/<repository>:<tag>, <tag>-cuda for trainers with image.variant cuda */}}
{{- define "bagpipe.image" -}}
{{- $image := .root.Values.image -}}
{{- $tag := $image.tag | default .root.Chart.AppVersion -}}
{{- if and .values.image (eq (.values.image.variant | default "cpu") "cuda") }}{{ $tag = printf "%s-cuda" $tag }}{{ end -}}
{{- if $image.registry -}}
{{- printf "%s/%s:%s" (trimSuffix "/" $image.registry) $image.repository $tag -}}
{{- else -}}
{{- printf "%s:%s" $image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* The container's image and command: `bagpipe <service>` */}}
{{- define "bagpipe.container" -}}
image: {{ include "bagpipe.image" . | quote }}
imagePullPolicy: {{ .root.Values.image.pullPolicy }}
command: ["bagpipe", {{ .service | default .component | quote }}]
{{- end -}}

{{/* The run's volume (persistence): its claim name */}}
{{- define "bagpipe.claimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-run" (include "bagpipe.fullname" .)) -}}
{{- end -}}

{{/* A path on the run's volume; fails when persistence is off (the value that needs it is named) */}}
{{- define "bagpipe.runPath" -}}
{{- $root := index . 0 -}}
{{- if not $root.Values.persistence.enabled -}}
{{- fail (printf "%s needs persistence.enabled (a volume the trainers and embedding servers share)" (index . 2)) -}}
{{- end -}}
{{- printf "%s/%s" $root.Values.persistence.mountPath (index . 1) -}}
{{- end -}}

{{/* Values that are each valid but do not fit together fail `helm template` here, before anything runs */}}
{{- define "bagpipe.validate" -}}
{{- $t := .Values.training -}}
{{- $trainers := int .Values.trainer.replicaCount -}}
{{- if gt $trainers 256 -}}
{{- fail (printf "trainer.replicaCount=%d: at most 256 trainers (the oracle's per-key trainer masks are 256 bits)" $trainers) -}}
{{- end -}}
{{- if mod (int64 $t.batchSize) $trainers -}}
{{- fail (printf "training.batchSize=%d does not split over trainer.replicaCount=%d trainers: use a multiple of %d" (int64 $t.batchSize) $trainers $trainers) -}}
{{- end -}}
{{- include "bagpipe.validateSchema" . -}}
{{- $tables := include "bagpipe.tableCount" . | int -}}
{{- if and $t.tableRows (ne (len $t.tableRows) $tables) -}}
{{- if $t.schema -}}
{{- fail (printf "training.tableRows has %d entries: training.schema has %d categorical columns (one table each)" (len $t.tableRows) $tables) -}}
{{- else -}}
{{- fail (printf "training.tableRows has %d entries: %s data has %d tables" (len $t.tableRows) (splitList ":" $t.data | first) $tables) -}}
{{- end -}}
{{- end -}}
{{- if eq $t.model "dlrm" -}}
{{- $bottom := last $t.bottomMlp | int64 -}}
{{- if ne $bottom (int64 $t.embeddingDim) -}}
{{- fail (printf "training.bottomMlp ends in %d but training.embeddingDim is %d: DLRM's bottom MLP must end in the embedding width" $bottom (int64 $t.embeddingDim)) -}}
{{- end -}}
{{- if ne (last $t.topMlp | int64) 1 -}}
{{- fail (printf "training.topMlp ends in %d: the top MLP must end in 1 (the click logit)" (last $t.topMlp | int64)) -}}
{{- end -}}
{{- end -}}
{{- if and (eq $t.data "synthetic") (eq (int64 $t.iterations) 0) -}}
{{- fail "training.iterations=0 reads the whole input, but synthetic data is endless: give a number of batches" -}}
{{- end -}}
{{- if and (ne $t.data "synthetic") (not $t.dataVolume.claimName) -}}
{{- fail (printf "training.data=%s reads files: set training.dataVolume.claimName (mounted at /data)" $t.data) -}}
{{- end -}}
{{- $evalKind := splitList ":" $t.eval.data | first -}}
{{- if and $t.eval.data (ne $t.eval.data "synthetic") (ne $evalKind (splitList ":" $t.data | first)) -}}
{{- fail (printf "training.eval.data=%s is not in the format of training.data=%s: held-out files are read as the training files are" $t.eval.data $t.data) -}}
{{- end -}}
{{- if and $t.eval.data (ne $t.eval.data "synthetic") (not $t.dataVolume.claimName) -}}
{{- fail (printf "training.eval.data=%s reads a file: set training.dataVolume.claimName (mounted at /data)" $t.eval.data) -}}
{{- end -}}
{{- if and (ne (toString $t.resumeBatch) "latest") (ne (toString $t.resumeBatch) "0") (not $t.checkpointEvery) -}}
{{- fail "training.resumeBatch needs training.checkpointEvery (the checkpoints it resumes from)" -}}
{{- end -}}
{{- $interval := toString .Values.trainer.metrics.interval -}}
{{- if regexMatch "^[0-9]+s$" $interval -}}
{{- $stale := .Values.prometheus.rules.heartbeatStaleSeconds | int64 -}}
{{- if lt $stale (mul 2 (trimSuffix "s" $interval | int64)) -}}
{{- fail (printf "prometheus.rules.heartbeatStaleSeconds=%d is below twice the scrape interval (trainer.metrics.interval=%s): a healthy trainer's heartbeat would look stale between scrapes" $stale $interval) -}}
{{- end -}}
{{- end -}}
{{- if and (eq (.Values.trainer.image.variant | default "cpu") "cuda") (eq .Values.trainer.device "cpu") -}}
{{- fail "trainer.image.variant=cuda with trainer.device=cpu: use device auto or cuda (or the cpu image)" -}}
{{- end -}}
{{- end -}}

{{/* training.schema, the input's layout (services/bagpipe/core/schema.py): csv:, tsv: and parquet: data need
     one, the built-in layouts (criteo:, avazu:, synthetic) take none. Checked here as far as a template can:
     its format, one label, a table per categorical column and each table's rows (the schema's, or
     training.tableRows); the services check the rest when they load it. */}}
{{- define "bagpipe.validateSchema" -}}
{{- $t := .Values.training -}}
{{- $kind := splitList ":" $t.data | first -}}
{{- if has $kind (list "csv" "tsv" "parquet") -}}
{{- if not $t.schema -}}
{{- fail (printf "training.data=%s needs training.schema: the layout of %s: files (the label, dense and categorical columns, each table's rows), which every service reads, not only the data processors that read the files" $t.data $kind) -}}
{{- end -}}
{{- else if $t.schema -}}
{{- fail (printf "training.schema applies to csv:, tsv: and parquet: data, not training.data=%s (%s data has its own layout): unset one of them" $t.data $kind) -}}
{{- end -}}
{{- with $t.schema -}}
{{- if not .columns -}}
{{- fail "training.schema has no columns: give its columns (each a name and a role), or {} for no schema" -}}
{{- end -}}
{{- if and .format (ne .format $kind) -}}
{{- fail (printf "training.schema.format is %s but training.data=%s is %s: data" .format $t.data $kind) -}}
{{- end -}}
{{- $labels := list -}}
{{- $seen := dict -}}
{{- $noRows := list -}}
{{- range .columns -}}
{{- if hasKey $seen .name -}}
{{- fail (printf "training.schema: column %s is named twice" .name) -}}
{{- end -}}
{{- $_ := set $seen .name true -}}
{{- if eq .role "label" }}{{ $labels = append $labels .name }}{{ end -}}
{{- if and (eq .role "categorical") (not .rows) }}{{ $noRows = append $noRows .name }}{{ end -}}
{{- end -}}
{{- if ne (len $labels) 1 -}}
{{- fail (printf "training.schema needs exactly one column with role label (the click, 0 or 1), got %s" (ternary (join ", " $labels) "none" (gt (len $labels) 0))) -}}
{{- end -}}
{{- if eq (include "bagpipe.tableCount" $) "0" -}}
{{- fail "training.schema needs at least one column with role categorical (one embedding table each)" -}}
{{- end -}}
{{- if and $noRows (not $t.tableRows) -}}
{{- fail (printf "training.schema gives no rows for categorical column(s) %s: give each its rows there, or set training.tableRows (one entry per categorical column, in order)" (join ", " $noRows)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The number of embedding tables: training.schema's categorical columns, else the built-in layout's (22 for
     avazu:, 26 for criteo: and synthetic data) */}}
{{- define "bagpipe.tableCount" -}}
{{- $t := .Values.training -}}
{{- if $t.schema -}}
{{- $n := 0 -}}
{{- range $t.schema.columns }}{{ if eq .role "categorical" }}{{ $n = add1 $n }}{{ end }}{{ end -}}
{{- $n -}}
{{- else if hasPrefix "avazu:" $t.data -}}
22
{{- else -}}
26
{{- end -}}
{{- end -}}

{{/* training.schema as the services read it: the ConfigMap's schema.json, mounted read-only in the data
     processors, the oracle, the embedding servers and the trainers */}}
{{- define "bagpipe.schemaName" -}}
{{- printf "%s-schema" (include "bagpipe.fullname" .) -}}
{{- end -}}

{{- define "bagpipe.schemaMountPath" -}}/etc/bagpipe/schema{{- end -}}

{{- define "bagpipe.schemaJson" -}}
{{- toPrettyJson .Values.training.schema -}}
{{- end -}}

{{- define "bagpipe.schemaVolumeMount" -}}
- name: schema
  mountPath: {{ include "bagpipe.schemaMountPath" . }}
  readOnly: true
{{- end -}}

{{- define "bagpipe.schemaVolume" -}}
- name: schema
  configMap:
    name: {{ include "bagpipe.schemaName" . }}
{{- end -}}

{{/* A component's pod annotations: its podAnnotations and, with training.schema, the schema's checksum, so a
     changed schema rolls the pods that read it (files mounted from a ConfigMap change, but a running
     service read its schema at start) */}}
{{- define "bagpipe.podAnnotations" -}}
{{- $annotations := deepCopy (.values.podAnnotations | default dict) -}}
{{- if .root.Values.training.schema -}}
{{- $_ := set $annotations "checksum/schema" (include "bagpipe.schemaJson" .root | sha256sum) -}}
{{- end -}}
{{- with $annotations -}}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end -}}
{{- end -}}

{{/* The job's Redis. TLS means TLS everywhere: with tls.enabled the bundled Redis speaks only TLS, and a
     plaintext external one is refused; the services dial rediss:// with the job's certificate and CA. */}}
{{- define "bagpipe.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "%s://%s-redis:%d/0" (ternary "rediss" "redis" .Values.tls.enabled) (include "bagpipe.fullname" .) (int .Values.redis.port) -}}
{{- else if .Values.externalRedis.url -}}
{{- if and .Values.tls.enabled (not (hasPrefix "rediss://" .Values.externalRedis.url)) -}}
{{- fail "tls.enabled is true but externalRedis.url is a plaintext redis:// URL: TLS means TLS everywhere, so give a rediss:// URL (the services present the job's certificate to it and trust the job's CA, ca.crt, unless the URL names its own with ?ssl_ca_certs=)" -}}
{{- end -}}
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

{{/* The job's oracle shards (oracleCacher.replicaCount), for those that talk to every one of them: the
     trainers, the embedding servers (a row tier follows their fetch streams) and the controller */}}
{{- define "bagpipe.oracleArgs" -}}
{{- if gt (int .Values.oracleCacher.replicaCount) 1 -}}
- --oracles
- {{ .Values.oracleCacher.replicaCount | int64 | quote }}
{{- end -}}
{{- end -}}

{{/* The input and its tables: data processors, the oracle, embedding servers and trainers */}}
{{- define "bagpipe.tableArgs" -}}
- --data
- {{ .Values.training.data | quote }}
{{- if .Values.training.schema }}
- --schema
- {{ printf "%s/schema.json" (include "bagpipe.schemaMountPath" .) | quote }}
{{- end }}
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
- {{ include "bagpipe.runPath" (list . .Values.training.initFrom "training.initFrom") | quote }}
{{- end }}
{{- end -}}

{{/* Recovery checkpoints on the run's volume (trainers and embedding servers) */}}
{{- define "bagpipe.checkpointArgs" -}}
{{- if .Values.training.checkpointEvery }}
- --checkpoint-dir
- {{ include "bagpipe.checkpointDir" . | quote }}
# a server that starts again loads the newest complete checkpoint; where the job begins is the controller's
# --start-batch (training.resumeBatch), and every member takes each generation's start from it
- --resume-batch
- latest
{{- end }}
{{- end -}}

{{/* The job's recovery checkpoints on the run's volume */}}
{{- define "bagpipe.checkpointDir" -}}
{{- include "bagpipe.runPath" (list . (printf "checkpoints/%s" .Release.Name) "training.checkpointEvery") -}}
{{- end -}}

{{/* training.resumeBatch as a flag's value: latest, or a batch number */}}
{{- define "bagpipe.resumeBatch" -}}
{{- if eq (toString .Values.training.resumeBatch) "latest" -}}latest{{- else -}}{{ .Values.training.resumeBatch | int64 }}{{- end -}}
{{- end -}}

{{/* Trainers: how many checkpoints are kept and how often one is full (rank 0 writes them) */}}
{{- define "bagpipe.checkpointChainArgs" -}}
{{- if .Values.training.checkpointEvery }}
- --keep-checkpoints
- {{ .Values.training.keepCheckpoints | int64 | quote }}
- --checkpoint-full-every
- {{ .Values.training.checkpointFullEvery | int64 | quote }}
{{- end }}
{{- end -}}

{{/* The run's volume in trainers and embedding servers */}}
{{- define "bagpipe.runVolumeMount" -}}
{{- if .Values.persistence.enabled }}
- name: run
  mountPath: {{ .Values.persistence.mountPath }}
{{- end }}
{{- end -}}

{{- define "bagpipe.runVolume" -}}
{{- if .Values.persistence.enabled }}
- name: run
  persistentVolumeClaim:
    claimName: {{ include "bagpipe.claimName" . }}
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

{{/* env every container gets: its pod IP (advertised in Redis), its pod's name (registered, so the controller
     can delete the pod: a Job pod's hostname is <job>-<index>, not its name), in StatefulSets its ordinal,
     and the job's credentials (the preStop drain hook inherits them) */}}
{{- define "bagpipe.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- if eq (toString .ordinal) "job" }}
- name: POD_INDEX
  valueFrom:
    fieldRef:
      fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
{{- else if .ordinal }}
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
serviceAccountName: {{ .serviceAccountName | default (include "bagpipe.serviceAccountName" .root) }}
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

{{/* The controller's --release targets, [{kind, name}] as JSON: the serving tiers it scales to zero once
     the job has finished, Redis last; none with controller.release off. Its Role names exactly these. */}}
{{- define "bagpipe.controller.releaseTargets" -}}
{{- $targets := list -}}
{{- if .Values.controller.release -}}
{{- $full := include "bagpipe.fullname" . -}}
{{- $targets = append $targets (dict "kind" "statefulset" "name" (printf "%s-embedding-server" $full)) -}}
{{- $targets = append $targets (dict "kind" "statefulset" "name" (printf "%s-oracle-cacher" $full)) -}}
{{- $targets = append $targets (dict "kind" "deployment" "name" (printf "%s-data-processor" $full)) -}}
{{- /* (not Redis: the job's record of its end, which the controller and helm test read, stays) */ -}}
{{- end -}}
{{- toJson $targets -}}
{{- end -}}
