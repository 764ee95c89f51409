{{/*
Helpers shared by every template. All are prefixed with the chart name ("carpool.") so that they
cannot collide with a parent chart's when carpool is used as a subchart.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "carpool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every object name: fullnameOverride, else "<release>-<chart>", else just the release
name when it already contains the chart name. Truncated to 63 characters (DNS label limit).
*/}}
{{- define "carpool.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* "<fullname>-<suffix>", kept within 63 characters. Call with (list . "suffix"). */}}
{{- define "carpool.componentName" -}}
{{- $root := index . 0 -}}
{{- printf "%s-%s" (include "carpool.fullname" $root | trunc (int (sub 62 (len (index . 1))))) (index . 1) | trimSuffix "-" -}}
{{- end -}}

{{/* Chart name and version, for the helm.sh/chart label. */}}
{{- define "carpool.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every object carries. */}}
{{- define "carpool.labels" -}}
helm.sh/chart: {{ include "carpool.chart" . }}
{{ include "carpool.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: carpool
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The immutable selector of the operator pods. */}}
{{- define "carpool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "carpool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Labels of the operator's objects (Deployment, pods, Service). */}}
{{- define "carpool.operator.labels" -}}
{{ include "carpool.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "carpool.operator.selectorLabels" -}}
{{ include "carpool.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "carpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "carpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name must name an existing ServiceAccount when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The operator image: repository@digest when a digest is set, else repository:tag (tag defaults to appVersion). */}}
{{- define "carpool.operator.image" -}}
{{- $image := .Values.operator.image -}}
{{- if $image.digest -}}
{{- printf "%s@%s" $image.repository $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (default .Chart.AppVersion $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The runtime pods' image (repository:tag, tag defaults to appVersion): the operator derives -cpu and -vllm from it. */}}
{{- define "carpool.runtime.image" -}}
{{- printf "%s:%s" .Values.runtimeImage.repository (default .Chart.AppVersion .Values.runtimeImage.tag) -}}
{{- end -}}

{{/* "true" when the operator replicas must elect one (a Lease) instead of running standalone. */}}
{{- define "carpool.operator.peered" -}}
{{- if gt (int .Values.operator.replicas) 1 }}true{{ end -}}
{{- end -}}

{{/*
The watched namespaces, de-duplicated, as a list; empty means cluster-wide.
*/}}
{{- define "carpool.watchNamespaces" -}}
{{- toJson (uniq .Values.watchNamespaces) -}}
{{- end -}}

{{/* The leader-election Lease's name. */}}
{{- define "carpool.operator.leaseName" -}}
{{- default (include "carpool.fullname" .) .Values.operator.leaderElection.leaseName -}}
{{- end -}}
