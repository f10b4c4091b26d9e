{{- /*
Security wiring: API keys, admin keys and HTTPS for the controller, TLS/mTLS and a shared token
between the controller and executors. Secrets are mounted read-only under /etc/tandem/; those
the values do not name are generated (templates/generated-secrets.yaml).
*/}}

{{- define "tandem.sec.tlsOn" -}}
{{- if .Values.security.executorTLS.enabled }}true{{ end -}}
{{- end -}}

{{- /* "true" when the chart makes the executor TLS Secrets (TLS on, no Secret named). */}}
{{- define "tandem.sec.generateTLS" -}}
{{- $t := .Values.security.executorTLS -}}
{{- if and $t.enabled (not $t.secretName) (not $t.clientSecretName) }}true{{ end -}}
{{- end -}}

{{- /* The executors' TLS Secret. */}}
{{- define "tandem.sec.executorTLSSecret" -}}
{{- $t := .Values.security.executorTLS -}}
{{- if include "tandem.sec.generateTLS" . -}}
{{- printf "%s-executor-tls" (include "tandem.base" .) -}}
{{- else -}}
{{- required "security.executorTLS.secretName is required with a clientSecretName" $t.secretName -}}
{{- end -}}
{{- end -}}

{{- /* The controller's TLS Secret (client certificate and the executors' CA). */}}
{{- define "tandem.sec.controllerTLSSecret" -}}
{{- $t := .Values.security.executorTLS -}}
{{- if include "tandem.sec.generateTLS" . -}}
{{- printf "%s-controller-tls" (include "tandem.base" .) -}}
{{- else -}}
{{- default $t.secretName $t.clientSecretName -}}
{{- end -}}
{{- end -}}

{{- /* The executor token's Secret ("" when the token is off). */}}
{{- define "tandem.sec.tokenSecret" -}}
{{- $k := .Values.security.executorToken -}}
{{- if $k.enabled -}}
{{- default (printf "%s-executor-token" (include "tandem.base" .)) $k.existingSecret -}}
{{- end -}}
{{- end -}}

{{- /* The admin keys' Secret ("" when admin keys are off). */}}
{{- define "tandem.sec.adminSecret" -}}
{{- $k := .Values.security.adminKeys -}}
{{- if $k.enabled -}}
{{- default (printf "%s-admin-keys" (include "tandem.base" .)) $k.existingSecret -}}
{{- end -}}
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
{{- if include "tandem.sec.adminSecret" . }}
- --admin-api-key-file
- {{ printf "/etc/tandem/admin-keys/%s" $s.adminKeys.key | quote }}
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
{{- if include "tandem.sec.tokenSecret" . }}
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
{{- if include "tandem.sec.adminSecret" . }}
- name: admin-keys
  mountPath: /etc/tandem/admin-keys
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
{{- if include "tandem.sec.tokenSecret" . }}
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
{{- with (include "tandem.sec.adminSecret" .) }}
- name: admin-keys
  secret:
    secretName: {{ . }}
{{- end }}
{{- if $s.https.secretName }}
- name: https
  secret:
    secretName: {{ $s.https.secretName }}
{{- end }}
{{- if $s.executorTLS.enabled }}
- name: executor-tls
  secret:
    secretName: {{ include "tandem.sec.controllerTLSSecret" . }}
{{- end }}
{{- with (include "tandem.sec.tokenSecret" .) }}
- name: executor-token
  secret:
    secretName: {{ . }}
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
{{- if include "tandem.sec.tokenSecret" . }}
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
{{- if include "tandem.sec.tokenSecret" . }}
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
    secretName: {{ include "tandem.sec.executorTLSSecret" . }}
{{- end }}
{{- with (include "tandem.sec.tokenSecret" .) }}
- name: executor-token
  secret:
    secretName: {{ . }}
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
