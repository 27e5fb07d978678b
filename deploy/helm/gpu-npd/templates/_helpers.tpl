{{/*
The chart's name: "gpu-npd", or nameOverride.
*/}}
{{- define "gpu-npd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object's name: the release name when it contains the chart's name (a release called
gpu-npd gives deploy/base's names), else RELEASE-gpu-npd; fullnameOverride sets it outright. 63
characters at most (DNS labels), room left for the "-config" and "-metrics" suffixes.
*/}}
{{- define "gpu-npd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 55 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The helm.sh/chart label: NAME-VERSION.
*/}}
{{- define "gpu-npd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
What selects this release's pods: the DaemonSet's selector, the Service's and the PodMonitor's.
app.kubernetes.io/name is deploy/base's own label; the instance keeps two releases apart.
*/}}
{{- define "gpu-npd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-npd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Every object's labels: the selector labels and Helm's recommended ones.
*/}}
{{- define "gpu-npd.labels" -}}
helm.sh/chart: {{ include "gpu-npd.chart" . }}
{{ include "gpu-npd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "gpu-npd.imageTag" -}}
{{- .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "gpu-npd.image" -}}
{{- printf "%s:%s" .Values.image.repository (include "gpu-npd.imageTag" .) }}
{{- end }}

{{- define "gpu-npd.configMapName" -}}
{{- printf "%s-config" (include "gpu-npd.fullname" .) }}
{{- end }}

{{- define "gpu-npd.serviceName" -}}
{{- printf "%s-metrics" (include "gpu-npd.fullname" .) }}
{{- end }}

{{/*
The ServiceAccount the pods run as.
*/}}
{{- define "gpu-npd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gpu-npd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.create is false: name the existing account in serviceAccount.name" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The Pod Security level the pods need: privileged (/dev/kmsg, host paths), or baseline when unprivileged.
*/}}
{{- define "gpu-npd.podSecurityLevel" -}}
{{- if .Values.unprivileged }}baseline{{ else }}privileged{{ end }}
{{- end }}

{{/*
Where the ConfigMap is mounted, and so where --config and --rules look.
*/}}
{{- define "gpu-npd.configDir" -}}
/etc/gpu-npd
{{- end }}

{{/*
gpuNodeSelectorTerms, each with {key: type, operator: NotIn, values: [kwok]} added unless the term
already says something about the label `type`; as YAML {terms: [...]} (fromYaml reads maps only).
*/}}
{{- define "gpu-npd.nodeSelectorTerms" -}}
{{- $terms := list }}
{{- range .Values.gpuNodeSelectorTerms }}
{{- $expressions := .matchExpressions | default list }}
{{- $aboutType := false }}
{{- range $expressions }}
{{- if eq .key "type" }}{{ $aboutType = true }}{{ end }}
{{- end }}
{{- if not $aboutType }}
{{- $expressions = append $expressions (dict "key" "type" "operator" "NotIn" "values" (list "kwok")) }}
{{- end }}
{{- $terms = append $terms (merge (dict "matchExpressions" $expressions) (omit . "matchExpressions")) }}
{{- end }}
{{- toYaml (dict "terms" $terms) }}
{{- end }}

{{/*
Fails the render on combinations that make no sense.
*/}}
{{- define "gpu-npd.validate" -}}
{{- if and (not .Values.rules.builtin) (not .Values.rules.files) }}
{{- fail "rules.builtin is false and rules.files is empty: gpu-npd would have no rules (it would load the bundled ones after all). Give a rule file in rules.files, or set rules.builtin to true." }}
{{- end }}
{{- if and .Values.podMonitor.enabled .Values.serviceMonitor.enabled }}
{{- fail "podMonitor.enabled and serviceMonitor.enabled are both true: every pod would be scraped twice. Enable one (the PodMonitor also scrapes pods that are not ready; values.yaml says why that matters)." }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not .Values.service.enabled) }}
{{- fail "serviceMonitor.enabled needs service.enabled: a ServiceMonitor scrapes through the metrics Service." }}
{{- end }}
{{- if hasKey .Values.rules.files "config.yaml" }}
{{- fail "rules.files: config.yaml is the check settings' file in the ConfigMap; name the rule file otherwise." }}
{{- end }}
{{- end }}
