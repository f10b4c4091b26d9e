{{- /*
The model every server container serves, and where it comes from (model.source):
- hf: a Hugging Face Hub id, fetched at startup by each program into a cache volume (the
  controller fetches config and tokenizer files, executors the weights too);
- pvc, hostPath, initContainer: a directory <mountPath>/<name> on a read-only volume.
*/}}

{{- define "tandem.hf" -}}
{{- if eq .Values.model.source "hf" }}true{{ end -}}
{{- end -}}

{{/* The model directory inside every container (the directory sources). */}}
{{- define "tandem.modelDir" -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (required "model.name is required" .Values.model.name) -}}
{{- end -}}

{{/* The Hub id (source hf). */}}
{{- define "tandem.hfId" -}}
{{- required "model.hf.id is required when model.source is hf" .Values.model.hf.id -}}
{{- end -}}

{{/* The name clients use: servedModelName, else the Hub id or the directory's name. */}}
{{- define "tandem.servedModelName" -}}
{{- if .Values.model.servedModelName -}}
{{- .Values.model.servedModelName -}}
{{- else if include "tandem.hf" . -}}
{{- include "tandem.hfId" . -}}
{{- else -}}
{{- .Values.model.name -}}
{{- end -}}
{{- end -}}

{{/* Where the Hub token file is mounted (source hf with a token Secret). */}}
{{- define "tandem.hfTokenDir" -}}
/etc/tandem/hf-token
{{- end -}}

{{/* The model flags of every server container (list items). */}}
{{- define "tandem.modelArgs" -}}
{{- $m := .Values.model -}}
- --model
{{- if include "tandem.hf" . }}
- {{ include "tandem.hfId" . | quote }}
{{- with $m.hf.revision }}
- --revision
- {{ . | quote }}
{{- end }}
- --download-dir
- {{ printf "%s/hub" (trimSuffix "/" $m.hf.cache.mountPath) | quote }}
{{- if $m.hf.tokenSecret.name }}
- --hf-token-file
- {{ printf "%s/%s" (include "tandem.hfTokenDir" .) $m.hf.tokenSecret.key | quote }}
{{- end }}
{{- else }}
- {{ include "tandem.modelDir" . | quote }}
{{- end }}
- --served-model-name
- {{ include "tandem.servedModelName" . | quote }}
{{- end -}}

{{/* Environment of the Hub's client (source hf; list items, or nothing). */}}
{{- define "tandem.modelEnv" -}}
{{- $m := .Values.model -}}
{{- if include "tandem.hf" . }}
- name: HF_HOME
  value: {{ trimSuffix "/" $m.hf.cache.mountPath | quote }}
{{- if $m.hf.offline }}
- name: HF_HUB_OFFLINE
  value: "1"
{{- end }}
{{- end }}
{{- end -}}

{{/* An emptyDir's fields (flow style; {} when none) from values with medium and sizeLimit. */}}
{{- define "tandem.emptyDir" -}}
{{- $e := dict -}}
{{- with .medium }}{{ $_ := set $e "medium" . }}{{ end -}}
{{- with .sizeLimit }}{{ $_ := set $e "sizeLimit" . }}{{ end -}}
{{- toJson $e -}}
{{- end -}}

{{/* The model volumes (list items). */}}
{{- define "tandem.modelVolume" -}}
{{- $m := .Values.model -}}
- name: model
{{- if eq $m.source "hf" }}
{{- if $m.hf.cache.claimName }}
  persistentVolumeClaim:
    claimName: {{ $m.hf.cache.claimName }}
{{- else }}
  emptyDir: {{ include "tandem.emptyDir" $m.hf.cache }}
{{- end }}
{{- with $m.hf.tokenSecret.name }}
- name: hf-token
  secret:
    secretName: {{ . }}
{{- end }}
{{- else if eq $m.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type | default "Directory" }}
{{- else if eq $m.source "initContainer" }}
  emptyDir: {{ include "tandem.emptyDir" $m.initContainer }}
{{- else }}
{{- fail (printf "model.source must be hf, pvc, hostPath or initContainer, not %q" $m.source) }}
{{- end }}
{{- end -}}

{{/*
The model mounts of a server container (list items): the Hub cache, written by the program
that fetches into it (read-only in offline mode), or the model directory's volume, read-only.
*/}}
{{- define "tandem.modelMount" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "hf" }}
- name: model
  mountPath: {{ $m.hf.cache.mountPath }}
  readOnly: {{ $m.hf.offline }}
{{- if $m.hf.tokenSecret.name }}
- name: hf-token
  mountPath: {{ include "tandem.hfTokenDir" . }}
  readOnly: true
{{- end }}
{{- else }}
- name: model
  mountPath: {{ $m.mountPath }}
  readOnly: true
  {{- if and (eq $m.source "pvc") $m.pvc.subPath }}
  subPath: {{ $m.pvc.subPath }}
  {{- end }}
{{- end }}
{{- end -}}

{{/*
The init container that fills the model emptyDir, or nothing for the other sources.
Takes (dict "root" $ "component" "controller" "securityContext" {...}).
*/}}
{{- define "tandem.modelInitContainers" -}}
{{- $m := .root.Values.model -}}
{{- if eq $m.source "initContainer" }}
- name: fetch-model
  image: {{ required "model.initContainer.image is required when model.source is initContainer" $m.initContainer.image }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  {{- with $m.initContainer.command }}
  command:
    {{- range . }}
    - {{ . | quote }}
    {{- end }}
  {{- end }}
  {{- with $m.initContainer.args }}
  args:
    {{- range . }}
    - {{ . | quote }}
    {{- end }}
  {{- end }}
  env:
    - name: MODEL_DIR
      value: {{ include "tandem.modelDir" .root | quote }}
    - name: MODEL_NAME
      value: {{ $m.name | quote }}
    - name: TANDEM_COMPONENT
      value: {{ .component | quote }}
    {{- with $m.initContainer.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with $m.initContainer.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end -}}
