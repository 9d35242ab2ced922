{{- define "ggmux.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ggmux.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "ggmux.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "ggmux.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ggmux.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{ include "ggmux.selectorLabels" . }}
{{- end -}}

{{/* the pods' labels: the Service's and the InferencePool's selector */}}
{{- define "ggmux.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ggmux.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: model-server
{{- end -}}

{{- define "ggmux.secretName" -}}
{{- default (include "ggmux.fullname" .) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "ggmux.picker" -}}
{{- printf "%s-picker" (include "ggmux.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* where the pods publish KV events (kvEvents.endpoint, else the chart's picker, else bind) */}}
{{- define "ggmux.kvEndpoint" -}}
{{- if .Values.kvEvents.endpoint -}}
{{- .Values.kvEvents.endpoint -}}
{{- else if .Values.inferencePool.enabled -}}
{{- printf "tcp://%s:%d" (include "ggmux.picker" .) (int .Values.inferencePool.picker.kvEventsPort) -}}
{{- else -}}
tcp://*:5557
{{- end -}}
{{- end -}}

{{- define "ggmux.natsUrl" -}}
{{- if .Values.cluster.url -}}
{{- .Values.cluster.url -}}
{{- else -}}
{{- printf "nats://%s-nats:4222" .Release.Name -}}
{{- end -}}
{{- end -}}
