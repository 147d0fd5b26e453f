{{- define "diloco-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "diloco-operator.fullname" -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "diloco-operator.labels" -}}
app.kubernetes.io/name: {{ include "diloco-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "diloco-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "diloco-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "diloco-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "diloco-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces a namespaced operator manages: watchNamespaces, else the release's own. */}}
{{- define "diloco-operator.namespaces" -}}
{{- if .Values.clusterWide -}}
{{- if .Values.watchNamespaces -}}
{{- fail "clusterWide: true and watchNamespaces are exclusive: pick one" -}}
{{- end -}}
[]
{{- else -}}
{{- default (list .Release.Namespace) .Values.watchNamespaces | toJson -}}
{{- end -}}
{{- end -}}

{{/* What the operator does inside a namespace it manages: nothing more. */}}
{{- define "diloco-operator.namespacedRules" -}}
# DilocoRuns: watched; kopf patches its annotations/finalizer; status written once per pass.
- apiGroups: ["diloco.dev"]
  resources: ["dilocoruns"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["diloco.dev"]
  resources: ["dilocoruns/status"]
  verbs: ["get", "patch"]
# Learner units: Indexed Jobs (watched, created, deleted; patched: spec.suspend) and their pods
# (watched). (get: a create that meets an existing object reads it to check it is the run's own.)
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Unit subdomains and the syncer Service.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "delete"]
# The syncer: Deployment (watched for readiness), token Secret (read to poll its status),
# config and checkpoint storage.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create"]
# The syncer scaled to zero while its run is suspended (spec.suspend), and back.
- apiGroups: ["apps"]
  resources: ["deployments/scale"]
  verbs: ["patch"]
# A run labelled kueue.x-k8s.io/queue-name: does that LocalQueue exist (condition QueueFound)?
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["localqueues"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["configmaps", "persistentvolumeclaims"]
  verbs: ["get", "create"]
# The syncer's PodDisruptionBudget: drains and the autoscaler leave the syncer pod alone.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create"]
# A syncer exposed through a Gateway (syncer.expose.gateway): its TLSRoute or HTTPRoute.
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["tlsroutes", "httproutes"]
  verbs: ["get", "create"]
# Events about runs and units.
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- if .Values.networkPolicy.enabled }}
# The per-run NetworkPolicy: only the run's learners and this operator reach its syncer.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create"]
{{- end }}
{{- if .Values.ha.enabled }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- if .Values.chaos.enabled }}
# Chaos (chaos.enabled): spec.chaos kills delete a unit's or the syncer's pods with no grace.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["delete"]
{{- end }}
{{- end -}}

{{/* The spec of a GMP (Cluster)PodMonitoring of one kind of run pod. */}}
{{- define "diloco-operator.podMonitoringSpec" -}}
selector:
  matchLabels:
    app.kubernetes.io/name: diloco
    app.kubernetes.io/component: {{ .component.name }}
    {{- range $key, $value := .component.only }}
    {{ $key }}: {{ $value | quote }}
    {{- end }}
endpoints:
  - port: {{ .component.port }}
    path: /metrics
    interval: {{ .interval }}
targetLabels:
  fromPod:
    - from: diloco.dev/run
      to: run
{{- end -}}
