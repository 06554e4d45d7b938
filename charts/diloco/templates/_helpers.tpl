{{- define "diloco.fullname" -}}
{{- if contains "diloco" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-diloco" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "diloco.labels" -}}
app.kubernetes.io/name: diloco-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The operator's own pod labels: NetworkPolicies of jobs admit pods labelled app.kubernetes.io/name=diloco-operator. */}}
{{- define "diloco.selectorLabels" -}}
app.kubernetes.io/name: diloco-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "diloco.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "diloco.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Rules on namespaced resources, shared by the ClusterRole (all namespaces) and the per-namespace Roles. */}}
{{- define "diloco.namespacedRules" -}}
- apiGroups: [diloco.dev]
  resources: [dilocojobs]
  verbs: [list, watch, patch, delete]
- apiGroups: [diloco.dev]
  resources: [dilocojobs/status]
  verbs: [patch]
- apiGroups: [""]
  resources: [configmaps, secrets, services, persistentvolumeclaims]
  verbs: [list, get, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [list, get, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [list, get, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [list, get, create, patch, delete]
- apiGroups: [gateway.networking.k8s.io]
  resources: [grpcroutes]
  verbs: [list, get, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [list]
- apiGroups: [""]
  resources: [events]
  verbs: [create, get, patch]
{{- end -}}
