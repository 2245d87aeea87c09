{{/* Labels helm adds to every object's metadata (the kustomize base has none of these). */}}
{{- define "ipwarden.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}

{{/* The image of both containers and the init container. */}}
{{- define "ipwarden.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "ipwarden.pullPolicy" -}}
{{- with .Values.image.pullPolicy }}
imagePullPolicy: {{ . }}
{{- end }}
{{- end }}

{{/* The service account user names the admission policies match. */}}
{{- define "ipwarden.agentUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:ipwarden-agent
{{- end }}
{{- define "ipwarden.controllerUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:ipwarden-controller
{{- end }}
