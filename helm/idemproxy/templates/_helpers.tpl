{{- define "idemproxy.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "idemproxy.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "idemproxy.selectorLabels" -}}
app.kubernetes.io/name: {{ include "idemproxy.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "idemproxy.labels" -}}
{{ include "idemproxy.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "idemproxy.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{- define "idemproxy.secretName" -}}
{{- .Values.secrets.existingSecret | default (include "idemproxy.fullname" .) }}
{{- end }}

{{/* Refuse values that would start a broken or leaky release, with a message naming the value. */}}
{{- define "idemproxy.validate" -}}
{{- $v := .Values }}
{{- $config := $v.proxy.config | default dict }}
{{- if hasKey $config "store" }}
{{- fail "proxy.config.store: secrets never go in the ConfigMap; set secrets.store or secrets.existingSecret" }}
{{- end }}
{{- /* The redis block's options may go in the ConfigMap; its URL (it may hold a password) not. */}}
{{- if and (hasKey $config "redis") (or (not (kindIs "map" $config.redis)) (hasKey ($config.redis | default dict) "url")) }}
{{- fail "proxy.config.redis.url: secrets never go in the ConfigMap; set secrets.redis or secrets.existingSecret" }}
{{- end }}
{{- if and (kindIs "map" $config.admin) (hasKey $config.admin "token") }}
{{- fail "proxy.config.admin.token: secrets never go in the ConfigMap; set secrets.adminToken or secrets.existingSecret" }}
{{- end }}
{{- if not $v.secrets.existingSecret }}
{{- if not $v.secrets.store }}
{{- fail "secrets.store: set the PostgreSQL DSN, or secrets.existingSecret" }}
{{- end }}
{{- if not $v.secrets.adminToken }}
{{- fail "secrets.adminToken: the admin listener is off loopback (probes), so it needs a token; or set secrets.existingSecret" }}
{{- end }}
{{- end }}
{{- if eq $v.mode "sidecar" }}
{{- if not $v.app.image.repository }}
{{- fail "app.image.repository: sidecar mode needs your application's image" }}
{{- end }}
{{- if or (eq (int $v.app.port) (int $v.proxy.port)) (eq (int $v.app.port) (int $v.proxy.adminPort)) }}
{{- fail "app.port: must differ from proxy.port and proxy.adminPort (one pod, one network namespace)" }}
{{- end }}
{{- else if not (or $config.upstream $config.routes) }}
{{- fail "proxy.config: standalone mode needs `upstream` or `routes`" }}
{{- end }}
{{- if le (int $v.drain.terminationGracePeriodSeconds) (add $v.drain.preStopSeconds $v.drain.shutdownTimeout | int) }}
{{- fail "drain.terminationGracePeriodSeconds: must be longer than drain.preStopSeconds + drain.shutdownTimeout" }}
{{- end }}
{{- end }}

{{/* The settings file: the user's proxy.config with what the chart owns set over it. */}}
{{- define "idemproxy.config" -}}
{{- $config := deepCopy (.Values.proxy.config | default dict) }}
{{- $admin := deepCopy ($config.admin | default dict) }}
{{- $_ := set $admin "listen" (printf "0.0.0.0:%d" (int .Values.proxy.adminPort)) }}
{{- $server := deepCopy ($config.server | default dict) }}
{{- $_ := set $server "shutdown_timeout" .Values.drain.shutdownTimeout }}
{{- $_ := set $config "admin" $admin }}
{{- $_ := set $config "server" $server }}
{{- $_ := set $config "listen" (printf "0.0.0.0:%d" (int .Values.proxy.port)) }}
{{- $_ := set $config "migrate" (not .Values.migrations.hook) }}
{{- if eq .Values.mode "sidecar" }}
{{- $_ := set $config "upstream" (printf "http://127.0.0.1:%d" (int .Values.app.port)) }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{- define "idemproxy.secretEnv" -}}
- name: IDEMPROXY_STORE
  valueFrom:
    secretKeyRef: {name: {{ include "idemproxy.secretName" . }}, key: store}
{{- end }}

{{/* The idemproxy container, less its name (and lifecycle: the deployment decides). */}}
{{- define "idemproxy.proxyContainer" -}}
image: {{ include "idemproxy.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args: [serve]
ports:
  - {name: http, containerPort: {{ .Values.proxy.port }}}
  - {name: admin, containerPort: {{ .Values.proxy.adminPort }}}
env:
  - name: IDEMPROXY_CONFIG
    value: /etc/idemproxy/idemproxy.yaml
  {{- include "idemproxy.secretEnv" . | nindent 2 }}
  - name: IDEMPROXY_ADMIN__TOKEN
    valueFrom:
      secretKeyRef: {name: {{ include "idemproxy.secretName" . }}, key: admin-token}
  - name: IDEMPROXY_REDIS__URL
    valueFrom:
      secretKeyRef: {name: {{ include "idemproxy.secretName" . }}, key: redis, optional: true}
livenessProbe:
  httpGet: {path: /healthz, port: admin}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /readyz, port: admin}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
resources:
  {{- toYaml .Values.proxy.resources | nindent 2 }}
securityContext:
  {{- toYaml (merge (dict "runAsUser" 10001 "runAsGroup" 10001) .Values.securityContext) | nindent 2 }}
volumeMounts:
  - {name: config, mountPath: /etc/idemproxy, readOnly: true}
  - {name: tmp, mountPath: /tmp}
{{- end }}
