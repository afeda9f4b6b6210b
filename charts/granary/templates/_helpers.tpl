{{/* The release's base name: the release name, with "-granary" unless it says granary already. */}}
{{- define "granary.fullname" -}}
{{- if contains "granary" .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-granary" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "granary.labels" -}}
app.kubernetes.io/name: granary
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: (dict "ctx" $ "component" "master") */}}
{{- define "granary.selector" -}}
app.kubernetes.io/name: granary
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "granary.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* Every master's address, comma-separated (stable DNS names of the headless Service). */}}
{{- define "granary.masterAddrs" -}}
{{- $full := include "granary.fullname" . -}}
{{- $addrs := list -}}
{{- range $i := until (int .Values.master.replicas) -}}
{{- $addrs = append $addrs (printf "%s-master-%d.%s-master.%s.svc:%d" $full $i $full $.Release.Namespace (int $.Values.master.port)) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- end -}}

{{/* The masters' --peers as a TOML inline table: { 1 = "host:port", ... } (id = ordinal + 1). */}}
{{- define "granary.peers" -}}
{{- $full := include "granary.fullname" . -}}
{{- $peers := list -}}
{{- range $i := until (int .Values.master.replicas) -}}
{{- $peers = append $peers (printf "%d = \"%s-master-%d.%s-master.%s.svc:%d\"" (add1 $i) $full $i $full $.Release.Namespace (int $.Values.master.port)) -}}
{{- end -}}
{{- printf "{ %s }" (join ", " $peers) -}}
{{- end -}}

{{/* A Granary size with a binary unit ("8GiB") as a Kubernetes quantity ("8Gi"). */}}
{{- define "granary.quantity" -}}
{{- trimSuffix "B" . -}}
{{- end -}}

{{/* Transport security of a pod: (dict "ctx" $); with "ownDir" true the command names
     its --tls-dir itself (masters: the folder of their own id). */}}
{{- define "granary.tlsEnv" -}}
{{- if .ctx.Values.tls.enabled }}
{{- if not .ownDir }}
- name: GRANARY_TLS_DIR
  value: /etc/granary/tls
{{- end }}
{{- else }}
- name: GRANARY_INSECURE
  value: "1"
{{- end }}
- name: GRANARY_LOG
  value: {{ .ctx.Values.logLevel | quote }}
{{- end -}}

{{- define "granary.tlsVolume" -}}
{{- if .ctx.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ index .ctx.Values.tls.secrets .identity }}
    defaultMode: 0400
{{- end }}
{{- end -}}

{{/* The masters' identities, master-<id>/ each (a StatefulSet's pods share one spec: each
     master uses the folder of its own id). */}}
{{- define "granary.masterTlsVolume" -}}
{{- if .Values.tls.enabled }}
- name: tls
  projected:
    defaultMode: 0400
    sources:
      {{- range $i := until (int .Values.master.replicas) }}
      - secret:
          name: {{ printf "%s-%d" $.Values.tls.secrets.master (add1 $i) }}
          items:
            {{- range list "ca.crt" "tls.crt" "tls.key" }}
            - key: {{ . }}
              path: {{ printf "master-%d/%s" (add1 $i) . }}
            {{- end }}
      {{- end }}
{{- end }}
{{- end -}}

{{- define "granary.tlsMount" -}}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/granary/tls
  readOnly: true
{{- end }}
{{- end -}}

{{- define "granary.configMount" -}}
- name: config
  mountPath: /etc/granary/config
  readOnly: true
{{- end -}}

{{- define "granary.configVolume" -}}
- name: config
  configMap:
    name: {{ include "granary.fullname" . }}-config
{{- end -}}

{{/* Prometheus scrape annotations for a metrics port. */}}
{{- define "granary.scrape" -}}
{{- if .ctx.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{- define "granary.secretsKeySecret" -}}
{{- if .Values.secretsKey.existingSecret -}}
{{- .Values.secretsKey.existingSecret -}}
{{- else -}}
{{- include "granary.fullname" . }}-secrets-key
{{- end -}}
{{- end -}}

{{/* The worker's cache tiers as --tier values. */}}
{{- define "granary.tiers" -}}
{{- $t := .Values.worker.tiers -}}
{{- $tiers := list -}}
{{- if $t.memory.enabled -}}{{- $tiers = append $tiers (printf "\"mem:/cache/memory:%s\"" $t.memory.size) -}}{{- end -}}
{{- if $t.nvme.enabled -}}{{- $tiers = append $tiers (printf "\"ssd:/cache/nvme:%s\"" $t.nvme.size) -}}{{- end -}}
{{- if $t.hdd.enabled -}}{{- $tiers = append $tiers (printf "\"hdd:/cache/hdd:%s\"" $t.hdd.size) -}}{{- end -}}
{{- printf "[%s]" (join ", " $tiers) -}}
{{- end -}}

{{/*
A value as one word of a POSIX shell command: in single quotes, each quote inside written
as '\'' ("squote" leaves quotes inside as they are, so a value holding one ran as shell).
*/}}
{{- define "granary.shq" -}}
'{{ replace "'" "'\\''" (toString .) }}'
{{- end -}}
