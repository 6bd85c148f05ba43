{{- define "idemproxy.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "idemproxy.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name with a suffix, still a valid object (and Job label) name of at most 63. */}}
{{- define "idemproxy.suffixedName" -}}
{{- $suffix := printf "-%s" .suffix }}
{{- printf "%s%s" (include "idemproxy.fullname" .context | trunc (sub 63 (len $suffix) | int) | trimSuffix "-") $suffix }}
{{- end }}

{{- define "idemproxy.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- .Values.serviceAccount.name | default (include "idemproxy.fullname" .) }}
{{- else }}
{{- .Values.serviceAccount.name | default "default" }}
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

{{/* The proxy pods' labels: podLabels below the selector labels, which always win. */}}
{{- define "idemproxy.podLabels" -}}
{{- toYaml (merge (fromYaml (include "idemproxy.selectorLabels" .)) (deepCopy .Values.podLabels)) }}
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
{{- if and $v.metrics.serviceMonitor.enabled $v.metrics.podMonitor.enabled }}
{{- fail "metrics.serviceMonitor and metrics.podMonitor: enable one, not both (each pod would be scraped twice)" }}
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
{{- include "idemproxy.validateExtensions" . }}
{{- /* After the drain, what a proxy still has to write gets pool.store_timeout (5 s by default). */}}
{{- $pool := $config.pool | default dict }}
{{- $storeTimeout := 5 }}
{{- if and (kindIs "map" $pool) (hasKey $pool "store_timeout") }}{{ $storeTimeout = int $pool.store_timeout }}{{ end }}
{{- if le (int $v.drain.terminationGracePeriodSeconds) (add $v.drain.preStopSeconds $v.drain.shutdownTimeout $storeTimeout | int) }}
{{- fail "drain.terminationGracePeriodSeconds: must be longer than drain.preStopSeconds + drain.shutdownTimeout + proxy.config.pool.store_timeout (5 by default)" }}
{{- end }}
{{- end }}

{{/* extraEnv, extraVolumes and extraVolumeMounts may add to the pod, never replace the chart's own. */}}
{{- define "idemproxy.validateExtensions" -}}
{{- $v := .Values }}
{{- range $v.extraEnv }}
{{- if has .name (list "IDEMPROXY_CONFIG" "IDEMPROXY_STORE" "IDEMPROXY_ADMIN__TOKEN" "IDEMPROXY_REDIS" "IDEMPROXY_REDIS__URL") }}
{{- fail (printf "extraEnv: %s is the chart's own (the settings file, or a key of the Secret in secrets)" .name) }}
{{- end }}
{{- end }}
{{- $volumes := list }}
{{- range $v.extraVolumes }}
{{- if has .name (list "config" "tmp" "app-tmp") }}
{{- fail (printf "extraVolumes: the name %s is the chart's own volume; choose another" .name) }}
{{- end }}
{{- $volumes = append $volumes .name }}
{{- end }}
{{- range $v.extraVolumeMounts }}
{{- if not (has .name $volumes) }}
{{- fail (printf "extraVolumeMounts: %s names no volume of extraVolumes" .name) }}
{{- end }}
{{- if has (trimSuffix "/" .mountPath) (list "/etc/idemproxy" "/tmp") }}
{{- fail (printf "extraVolumeMounts: %s is where the chart mounts its own volume" .mountPath) }}
{{- end }}
{{- end }}
{{- end }}

{{/* The settings file: the user's proxy.config with what the chart owns set over it. */}}
{{- define "idemproxy.config.settings" -}}
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
args:
  - serve
  {{- range .Values.extraArgs }}
  - {{ . | quote }}
  {{- end }}
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
  {{- with .Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .Values.envFrom }}
envFrom:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.proxy.startupProbe }}
startupProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.proxy.livenessProbe }}
livenessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.proxy.readinessProbe }}
readinessProbe:
  {{- toYaml . | nindent 2 }}
{{- end }}
resources:
  {{- toYaml .Values.proxy.resources | nindent 2 }}
securityContext:
  {{- toYaml (merge (dict "runAsUser" 10001 "runAsGroup" 10001) .Values.securityContext) | nindent 2 }}
volumeMounts:
  - {name: config, mountPath: /etc/idemproxy, readOnly: true}
  - {name: tmp, mountPath: /tmp}
  {{- with .Values.extraVolumeMounts }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* NetworkPolicy peers: `from` as written, then one namespaceSelector per name in `namespaces`. */}}
{{- define "idemproxy.networkPeers" -}}
{{- $peers := .from | default list }}
{{- range .namespaces }}
{{- $peers = append $peers (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .))) }}
{{- end }}
{{- with $peers }}
{{- toYaml . }}
{{- end }}
{{- end }}

{{/* The TCP ports the URLs name, as a JSON list (several hosts in one URL give several); a URL
without a port gets 443 for https and `default` otherwise. */}}
{{- define "idemproxy.urlPorts" -}}
{{- $default := .default }}
{{- $ports := list }}
{{- range .urls }}
{{- $port := ternary 443 $default (hasPrefix "https://" .) }}
{{- $authority := regexReplaceAll "^[A-Za-z][A-Za-z0-9+.-]*://" . "" }}
{{- $authority = regexReplaceAll "[/?#].*$" $authority "" }}
{{- $authority = regexReplaceAll "^.*@" $authority "" }}
{{- range splitList "," $authority }}
{{- $given := regexFind ":[0-9]+$" . | trimPrefix ":" }}
{{- $ports = append $ports ($given | default $port | int) }}
{{- end }}
{{- end }}
{{- $ports | uniq | toJson }}
{{- end }}

{{/* One egress rule: to `rule.to` (empty: anywhere) on `rule.ports`, or else on the `ports`
the chart found in the settings; nothing when there are none. */}}
{{- define "idemproxy.egressRule" -}}
{{- $ports := .rule.ports }}
{{- if not $ports }}
{{- $ports = list }}
{{- range .ports }}
{{- $ports = append $ports (dict "port" . "protocol" "TCP") }}
{{- end }}
{{- end }}
{{- if $ports }}
- ports:
    {{- toYaml $ports | nindent 4 }}
  {{- with .rule.to }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{- /* The Prometheus Operator's API is in the cluster (or given to helm template with -a). */}}
{{- define "idemproxy.hasMonitoringApi" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end }}
{{- end }}

{{- /* A ServiceMonitor's or PodMonitor's endpoint: port, path, interval and the options set. */}}
{{- define "idemproxy.scrapeEndpoint" -}}
path: /metrics
interval: {{ .interval }}
{{- with .scrapeTimeout }}
scrapeTimeout: {{ . }}
{{- end }}
{{- with .relabelings }}
relabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .metricRelabelings }}
metricRelabelings:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
