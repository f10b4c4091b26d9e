{{- /*
Security wiring: API keys and HTTPS for the controller, TLS/mTLS and a shared token between the
controller and executors. Secrets are mounted read-only under /etc/tandem/.
*/}}

{{- define "tandem.sec.tlsOn" -}}
{{- if .Values.security.executorTLS.enabled }}true{{ end -}}
{{- end -}}

{{- /* Controller flags (before extraArgs). */}}
{{- define "tandem.controllerSecurityArgs" -}}
{{- $s := .Values.security -}}
{{- if $s.apiKeys.existingSecret }}
- --api-key-file
- {{ printf "/etc/tandem/api-keys/%s" $s.apiKeys.key | quote }}
{{- range $s.apiKeys.exemptPaths }}
- --auth-exempt-path
- {{ . | quote }}
{{- end }}
{{- end }}
{{- if $s.https.secretName }}
- --ssl-certfile
- /etc/tandem/https/tls.crt
- --ssl-keyfile
- /etc/tandem/https/tls.key
{{- end }}
{{- if $s.executorTLS.enabled }}
- --executor-tls-ca
- /etc/tandem/executor-tls/ca.crt
{{- if $s.executorTLS.mutual }}
- --executor-tls-cert
- /etc/tandem/executor-tls/tls.crt
- --executor-tls-key
- /etc/tandem/executor-tls/tls.key
{{- end }}
{{- with $s.executorTLS.serverName }}
- --executor-tls-server-name
- {{ . | quote }}
{{- end }}
{{- end }}
{{- if $s.executorToken.existingSecret }}
- --auth-token-file
- {{ printf "/etc/tandem/executor-token/%s" $s.executorToken.key | quote }}
{{- end }}
{{- end -}}

{{- define "tandem.controllerSecurityMounts" -}}
{{- $s := .Values.security -}}
{{- if $s.apiKeys.existingSecret }}
- name: api-keys
  mountPath: /etc/tandem/api-keys
  readOnly: true
{{- end }}
{{- if $s.https.secretName }}
- name: https
  mountPath: /etc/tandem/https
  readOnly: true
{{- end }}
{{- if $s.executorTLS.enabled }}
- name: executor-tls
  mountPath: /etc/tandem/executor-tls
  readOnly: true
{{- end }}
{{- if $s.executorToken.existingSecret }}
- name: executor-token
  mountPath: /etc/tandem/executor-token
  readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.controllerSecurityVolumes" -}}
{{- $s := .Values.security -}}
{{- if $s.apiKeys.existingSecret }}
- name: api-keys
  secret:
    secretName: {{ $s.apiKeys.existingSecret }}
{{- end }}
{{- if $s.https.secretName }}
- name: https
  secret:
    secretName: {{ $s.https.secretName }}
{{- end }}
{{- if $s.executorTLS.enabled }}
- name: executor-tls
  secret:
    secretName: {{ default (required "security.executorTLS.secretName is required" $s.executorTLS.secretName) $s.executorTLS.clientSecretName }}
{{- end }}
{{- if $s.executorToken.existingSecret }}
- name: executor-token
  secret:
    secretName: {{ $s.executorToken.existingSecret }}
{{- end }}
{{- end -}}

{{- /* Executor flags (before extraArgs). */}}
{{- define "tandem.executorSecurityArgs" -}}
{{- $s := .Values.security -}}
{{- if $s.executorTLS.enabled }}
- --tls-cert
- /etc/tandem/tls/tls.crt
- --tls-key
- /etc/tandem/tls/tls.key
{{- if $s.executorTLS.mutual }}
- --tls-client-ca
- /etc/tandem/tls/ca.crt
{{- end }}
- --health-port
- {{ $s.executorTLS.healthPort | int | quote }}
{{- end }}
{{- if $s.executorToken.existingSecret }}
- --auth-token-file
- {{ printf "/etc/tandem/executor-token/%s" $s.executorToken.key | quote }}
{{- end }}
{{- end -}}

{{- define "tandem.executorSecurityMounts" -}}
{{- $s := .Values.security -}}
{{- if $s.executorTLS.enabled }}
- name: tls
  mountPath: /etc/tandem/tls
  readOnly: true
{{- end }}
{{- if $s.executorToken.existingSecret }}
- name: executor-token
  mountPath: /etc/tandem/executor-token
  readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.executorSecurityVolumes" -}}
{{- $s := .Values.security -}}
{{- if $s.executorTLS.enabled }}
- name: tls
  secret:
    secretName: {{ required "security.executorTLS.secretName is required" $s.executorTLS.secretName }}
{{- end }}
{{- if $s.executorToken.existingSecret }}
- name: executor-token
  secret:
    secretName: {{ $s.executorToken.existingSecret }}
{{- end }}
{{- end -}}

{{- /* A controller httpGet probe from values, switched to HTTPS when the controller serves it. */}}
{{- define "tandem.controllerProbe" -}}
{{- $probe := deepCopy .probe -}}
{{- if and .root.Values.security.https.secretName $probe.httpGet }}
{{- $_ := set $probe.httpGet "scheme" "HTTPS" }}
{{- end }}
{{- toYaml $probe -}}
{{- end -}}
