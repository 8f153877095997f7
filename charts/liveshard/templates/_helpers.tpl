{{/* Names and labels shared by every template. */}}

{{- define "liveshard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "liveshard.fullname" -}}
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

{{/* The operator's objects: "<fullname>-operator". */}}
{{- define "liveshard.operator" -}}
{{- printf "%s-operator" (include "liveshard.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "liveshard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "liveshard.operator" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels that select the operator's pods (stable across upgrades). */}}
{{- define "liveshard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "liveshard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "liveshard.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "liveshard.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: liveshard
{{- end -}}

{{/*
The operator's rules on objects inside the namespaces it watches: exactly what kopf and
liveshard_operator call (tests/e2e/test_chart.py runs the operator under them).
*/}}
{{- define "liveshard.namespacedRules" -}}
# The jobs: kopf lists and watches them and patches its annotations and finalizer; the
# controller reads its job.
- apiGroups: [liveshard.io]
  resources: [elastictrainingjobs]
  verbs: [get, list, watch, patch]
- apiGroups: [liveshard.io]
  resources: [elastictrainingjobs/status]
  verbs: [patch]
# The workers' owner references set blockOwnerDeletion (OwnerReferencesPermissionEnforcement).
- apiGroups: [liveshard.io]
  resources: [elastictrainingjobs/finalizers]
  verbs: [update]
# The workers: created standing by, relabelled member, deleted once released.
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, patch, delete]
# The job's token and TLS Secrets, read by name (never listed), certificates renewed in place;
# owner references delete them.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, patch]
# One PodDisruptionBudget per job, so a drain takes one worker at a time.
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, create]
# A gang-scheduled job's PodGroup (scheduler-plugins' coscheduling, or Volcano's), when its kind
# is installed.
- apiGroups: [scheduling.x-k8s.io, scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [get, create]
{{- if .Values.networkPolicy.perJob }}
# Each job's NetworkPolicy (its workers reachable by each other and the operator only), its
# rules put back when they differ.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
{{- end }}
{{- if .Values.certManager.enabled }}
# With cert-manager, each job's Certificates, and its Issuers unless one of the user's issues
# them (the Secrets are cert-manager's).
- apiGroups: [cert-manager.io]
  resources: [{{ if not .Values.certManager.issuerRef.name }}issuers, {{ end }}certificates]
  verbs: [get, create]
{{- end }}
# An Event per reconfiguration (and kopf's own).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- end -}}

{{/* Rules on cluster-scoped objects, whatever the namespaces watched. */}}
{{- define "liveshard.clusterRules" -}}
# kopf discovers its resources and notices CRDs that appear or change.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
# A worker on a cordoned or NoExecute-tainted node leaves before it is evicted.
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list, watch]
{{- end -}}

{{/* The namespaces the operator watches, as JSON: [] for every namespace (watchAllNamespaces),
else watchNamespaces, else the release's namespace alone. */}}
{{- define "liveshard.watched" -}}
{{- if .Values.watchAllNamespaces -}}
{{- if .Values.watchNamespaces -}}
{{- fail "watchAllNamespaces and watchNamespaces: set one or the other" -}}
{{- end -}}
{{- toJson (list) -}}
{{- else if .Values.watchNamespaces -}}
{{- toJson .Values.watchNamespaces -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* The namespaces the NetworkPolicy goes to. */}}
{{- define "liveshard.networkPolicyNamespaces" -}}
{{- $watched := include "liveshard.watched" . | fromJsonArray -}}
{{- if .Values.networkPolicy.namespaces -}}
{{- toJson .Values.networkPolicy.namespaces -}}
{{- else if $watched -}}
{{- toJson $watched -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}
