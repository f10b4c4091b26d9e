{{/*
Base of every object name: fullnameOverride, else the release name. 39 characters at most so
that "<base>-tpu-executor" stays a valid StatefulSet name (52) whose pods' labels fit in 63.
*/}}
{{- define "tandem.base" -}}
{{- default .Release.Name .Values.fullnameOverride | trunc 39 | trimSuffix "-" -}}
{{- end -}}

{{/* The executor pools this chart knows, in render order. */}}
{{- define "tandem.poolNames" -}}
gpu tpu
{{- end -}}

{{/* Name of an executor pool's objects. Takes (dict "root" $ "pool" "gpu"). */}}
{{- define "tandem.executorName" -}}
{{- printf "%s-%s-executor" (include "tandem.base" .root) .pool -}}
{{- end -}}

{{- define "tandem.controllerName" -}}
{{- printf "%s-controller" (include "tandem.base" .) -}}
{{- end -}}

{{/* Selector labels. Takes (dict "root" $ "component" "controller"). */}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Every object's labels. Takes (dict "root" $ "component" "controller"). */}}
{{- define "tandem.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* A container image. Takes (dict "root" $ "image" .Values.controller.image). */}}
{{- define "tandem.image" -}}
{{- $tag := .image.tag | default .root.Values.image.tag | default .root.Chart.AppVersion | toString -}}
{{- $ref := printf "%s%s" .root.Values.image.registry .image.repository -}}
{{- if hasPrefix "sha256:" $tag -}}
{{- printf "%s@%s" $ref $tag -}}
{{- else -}}
{{- printf "%s:%s" $ref $tag -}}
{{- end -}}
{{- end -}}

{{- define "tandem.pullPolicy" -}}
{{- .image.pullPolicy | default .root.Values.image.pullPolicy -}}
{{- end -}}

{{- define "tandem.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "tandem.base" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
The address the controller resolves to find a pool's executors: the headless Service's name,
whose A records are the pool's ready pods. Takes (dict "root" $ "pool" "gpu").
*/}}
{{- define "tandem.executorDNS" -}}
{{- $p := index .root.Values .pool -}}
{{- printf "%s.%s.svc.%s:%d" (include "tandem.executorName" .) .root.Release.Namespace .root.Values.clusterDomain ($p.port | int) -}}
{{- end -}}

{{/* The controllers' headless Service (several controllers only), as --peer-dns takes it. */}}
{{- define "tandem.controllerPeersName" -}}
{{- printf "%s-peers" (include "tandem.controllerName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.controllerPeersDNS" -}}
{{- printf "%s.%s.svc.%s:%d" (include "tandem.controllerPeersName" .) .Release.Namespace .Values.clusterDomain (.Values.controller.port | int) -}}
{{- end -}}

{{/* Environment every Tandem container gets: a writable home and cache under /tmp. */}}
{{- define "tandem.baseEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{/* A probe: the handler plus the timing from values. Takes (dict "handler" {...} "timing" {...}). */}}
{{- define "tandem.probe" -}}
{{- toYaml (merge (deepCopy .handler) (deepCopy (default (dict) .timing))) -}}
{{- end -}}
