{{/* The operator's image: repository@digest, or repository:tag (tag default: appVersion). */}}
{{- define "rftjob-operator.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* What the operator may do in a namespace it watches: the ClusterRole's rules for a
cluster-wide install, a Role's in each watched namespace otherwise. */}}
{{- define "rftjob-operator.namespacedRules" -}}
- apiGroups: ["rft.dev"]
  resources: ["rftjobs"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["rft.dev"]
  # get+patch are also what the per-job Role grants: RBAC only lets us grant what we hold.
  resources: ["rftjobs/status"]
  verbs: ["get", "patch"]
- apiGroups: ["rft.dev"]
  # Children carry blockOwnerDeletion: the OwnerReferencesPermissionEnforcement admission
  # plugin (OpenShift enables it) requires update on the owner's finalizers for that.
  resources: ["rftjobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  # Kueue (docs/operator.md, "Queueing with Kueue"): the Workload of each job that names a LocalQueue,
  # and the part of its status a job's controller owns (admission cleared after an eviction,
  # PodsReady, Finished).
  resources: ["workloads"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads/status"]
  verbs: ["patch"]
{{- end -}}
