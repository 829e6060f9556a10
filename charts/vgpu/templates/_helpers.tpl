{{/* Names, labels, images and the install-time TLS material shared by the templates. */}}

{{/* vgpu.fullname: the prefix of every object name; "vgpu" for a release named vgpu. */}}
{{- define "vgpu.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* vgpu.labels: the labels of every object; call with (dict "ctx" $ "component" "scheduler"). */}}
{{- define "vgpu.labels" -}}
{{ include "vgpu.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: vgpu
{{- with .ctx.Values.global.labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* vgpu.selectorLabels: the immutable subset used in selectors; same argument as vgpu.labels. */}}
{{- define "vgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
vgpu.image: "registry/repository:tag", or "registry/repository@sha256:..." where the image's
digest is set (a digest names one image whatever the tag says, so the tag is left out); call with
(dict "ctx" $ "image" .Values.x.image "tag" "v1").
*/}}
{{- define "vgpu.image" -}}
{{- $registry := .ctx.Values.global.imageRegistry | default .image.registry -}}
{{- $tag := .tag | default .image.tag | default .ctx.Chart.AppVersion -}}
{{- $name := .image.repository -}}
{{- if $registry -}}
{{- $name = printf "%s/%s" (trimSuffix "/" $registry) .image.repository -}}
{{- end -}}
{{- if .image.digest -}}
{{- printf "%s@%s" $name .image.digest -}}
{{- else -}}
{{- printf "%s:%s" $name $tag -}}
{{- end -}}
{{- end -}}

{{/* vgpu.clusterVersion: the API server's version without build suffixes ("v1.33.1+k3s1" -> "v1.33.1"). */}}
{{- define "vgpu.clusterVersion" -}}
{{- regexFind "^v?[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- end -}}

{{/* vgpu.kubeSchedulerTag: scheduler.kubeScheduler.imageTag, or the cluster's own version. */}}
{{- define "vgpu.kubeSchedulerTag" -}}
{{- .Values.scheduler.kubeScheduler.imageTag | default (include "vgpu.clusterVersion" .) -}}
{{- end -}}

{{/*
vgpu.leaderLease: kube-scheduler's leader election Lease. Not "vgpu-..." like the plugins'
Leases (vgpu-<node>), so it can never be taken for the Lease of a node.
*/}}
{{- define "vgpu.leaderLease" -}}
{{- printf "kube-scheduler-%s" .Values.scheduler.schedulerName -}}
{{- end -}}

{{/* vgpu.extenderService: the name of the Service in front of the extender's HTTPS port. */}}
{{- define "vgpu.extenderService" -}}
{{- printf "%s-extender" (include "vgpu.fullname" .) -}}
{{- end -}}

{{/*
vgpu.tls: the extender's CA and serving certificate as a dict {ca, crt, key} of PEM strings.
Helm's genCAWithKey/genSignedCertWithKey make them at render time (no download, no Job), so
every `helm install` and `helm upgrade` makes a new pair. They are made once per render and kept
on the root context, so the Secret, kube-scheduler's caData and the webhooks' caBundle all agree.
ECDSA P-256 keys: kube-scheduler opens a new TLS connection to the extender whenever more binds
are in flight than the two connections it keeps idle, and the server's signature in each
handshake costs an RSA-2048 key several times what it costs a P-256 key.
*/}}
{{- define "vgpu.tls" -}}
{{- if not (hasKey . "vgpuTLS") -}}
{{- $svc := include "vgpu.extenderService" . -}}
{{- $ns := .Release.Namespace -}}
{{- $days := int .Values.webhook.certificate.validityDays -}}
{{- $ca := genCAWithKey (printf "%s-ca" (include "vgpu.fullname" .)) $days (genPrivateKey "ecdsa") -}}
{{- $names := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) "localhost" -}}
{{- /* the DNS names reach it through the Service (kube-scheduler, the API server); 127.0.0.1 and
localhost serve a probe or a debugging session inside the pod */ -}}
{{- $cert := genSignedCertWithKey (printf "%s.%s.svc" $svc $ns) (list "127.0.0.1") $names $days $ca (genPrivateKey "ecdsa") -}}
{{- /* kube-scheduler's client certificate: with scheduler.extender.clientAuth the extender answers
filter, prioritize and bind only to a certificate this CA signed */ -}}
{{- $client := genSignedCertWithKey "kube-scheduler" nil nil $days $ca (genPrivateKey "ecdsa") -}}
{{- $_ := set . "vgpuTLS" (dict "ca" $ca.Cert "crt" $cert.Cert "key" $cert.Key "clientCrt" $client.Cert "clientKey" $client.Key) -}}
{{- end -}}
{{- toYaml .vgpuTLS -}}
{{- end -}}

{{/* vgpu.imagePullSecrets: the pod spec's imagePullSecrets from global.imagePullSecrets. */}}
{{- define "vgpu.imagePullSecrets" -}}
{{- with .Values.global.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
vgpu.webhookCommon: what both webhooks share: pod creation, in the namespaces and pods the
values select, never in the release namespace: with failurePolicy Fail the extender's own pods
must still be creatable while no extender answers. Call with (dict "ctx" $ "guard" true) for the
validating webhook: where the tenant boundary's policies are off (tenantBoundary.policies) it
also sees pod updates and Bindings, to refuse placements written by anyone but the scheduler.
*/}}
{{- define "vgpu.webhookCommon" -}}
{{- $ctx := .ctx -}}
admissionReviewVersions: ["v1"]
sideEffects: None
failurePolicy: {{ $ctx.Values.webhook.failurePolicy }}
timeoutSeconds: {{ $ctx.Values.webhook.timeoutSeconds }}
rules:
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["CREATE"]
    resources: ["pods"]
    scope: Namespaced
  {{- if and .guard (not (include "vgpu.boundaryPolicies" $ctx)) }}
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["UPDATE"]
    resources: ["pods", "pods/status"]
    scope: Namespaced
  - apiGroups: [""]
    apiVersions: ["v1"]
    operations: ["CREATE"]
    resources: ["bindings", "pods/binding"]
    scope: Namespaced
  {{- end }}
namespaceSelector:
  {{- $selector := deepCopy ($ctx.Values.webhook.namespaceSelector | default dict) }}
  {{- $own := dict "key" "kubernetes.io/metadata.name" "operator" "NotIn" "values" (list $ctx.Release.Namespace) }}
  {{- $expressions := $selector.matchExpressions | default list }}
  {{- if not (has $own $expressions) }}
  {{- $_ := set $selector "matchExpressions" (append $expressions $own) }}
  {{- end }}
  {{- toYaml $selector | nindent 2 }}
{{- with $ctx.Values.webhook.objectSelector }}
objectSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
vgpu.devicePluginAffinity: devicePlugin.affinity with the one-mode-per-node rule added: every
required node selector term also needs openaios.io/gpu-mode NotIn [dra] (NotIn matches nodes
without the label: device-plugin nodes by default). The terms are ORed, so the rule goes into
each of them; without any, it is the one term.
*/}}
{{- define "vgpu.devicePluginAffinity" -}}
{{- $affinity := deepCopy (.Values.devicePlugin.affinity | default dict) -}}
{{- $rule := dict "key" "openaios.io/gpu-mode" "operator" "NotIn" "values" (list "dra") -}}
{{- $node := $affinity.nodeAffinity | default dict -}}
{{- $required := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default dict -}}
{{- $terms := list -}}
{{- range (get $required "nodeSelectorTerms" | default list) -}}
{{- $terms = append $terms (set (deepCopy .) "matchExpressions" (append (.matchExpressions | default list) $rule)) -}}
{{- end -}}
{{- if not $terms -}}
{{- $terms = list (dict "matchExpressions" (list $rule)) -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $terms -}}
{{- $_ = set $node "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ = set $affinity "nodeAffinity" $node -}}
{{- toYaml $affinity -}}
{{- end -}}

{{/*
vgpu.enforcementActions: every action the node monitors may take, as "a,b,...": the cluster-wide
devicePlugin.enforcement.memory and .compute and those of each nodeOverrides[].enforcement. The
DaemonSets and roles are one for all nodes, so each right an action needs (KILL, the host's
cgroups for throttle, pods/eviction) is given where any node may take it. "cgroups": the host's
pod cgroups are mounted, for the compute throttle's freezer and the driver's memory cap
(enforcement.driverCap: auto uses the mount where throttle makes it, required makes it itself and
adds "kill": it refuses a container no line holds). auto mounts nothing of its own, so an upgrade
never adds a hostPath that a node without devicePlugin.hostPaths.podCgroups would lack.
*/}}
{{- define "vgpu.enforcementActions" -}}
{{- $d := .Values.devicePlugin -}}
{{- $acts := list $d.enforcement.memory $d.enforcement.compute -}}
{{- $caps := list (toString (dig "driverCap" "auto" $d.enforcement)) -}}
{{- range $d.nodeOverrides -}}
{{- with .enforcement -}}
{{- with .memory }}{{ $acts = append $acts . }}{{ end -}}
{{- with .compute }}{{ $acts = append $acts . }}{{ end -}}
{{- if hasKey . "driverCap" }}{{ $caps = append $caps (toString .driverCap) }}{{ end -}}
{{- end -}}
{{- end -}}
{{- if or (has "throttle" $acts) (has "required" $caps) }}{{ $acts = append $acts "cgroups" }}{{ end -}}
{{- if has "required" $caps }}{{ $acts = append $acts "kill" }}{{ end -}}
{{- $acts | uniq | sortAlpha | join "," -}}
{{- end -}}

{{/*
vgpu.clientAuth: "true" where only kube-scheduler's client certificate may call the extender's
verbs (scheduler.extender.clientAuth). A release upgraded with --reuse-values keeps the values of
a chart that had no such key: absent, it is on, as the default.
*/}}
{{- define "vgpu.clientAuth" -}}
{{- if dig "clientAuth" true .Values.scheduler.extender -}}true{{- end -}}
{{- end -}}

{{/*
vgpu.boundaryPolicies: "true" where the tenant boundary's ValidatingAdmissionPolicies are
rendered (tenantBoundary.policies; absent, as in a release of an earlier chart upgraded with
--reuse-values, it is on, as the default).
*/}}
{{- define "vgpu.boundaryPolicies" -}}
{{- if dig "policies" true (.Values.tenantBoundary | default dict) -}}true{{- end -}}
{{- end -}}

{{/*
vgpu.podCgroups: the host's cgroup folders of the kubelet's pods (devicePlugin.hostPaths.podCgroups),
each mounted read-write at /host<path> for the compute throttle's freezer, and nothing else of the
host's cgroups. Call with (dict "ctx" $ "part" "mounts") for a container's volumeMounts, "volumes"
for the pod's volumes. Absent (a release of an earlier chart upgraded with --reuse-values):
/sys/fs/cgroup/kubepods.slice, the systemd driver's on cgroup v2.
*/}}
{{- define "vgpu.podCgroups" -}}
{{- $paths := dig "podCgroups" (list "/sys/fs/cgroup/kubepods.slice") (.ctx.Values.devicePlugin.hostPaths | default dict) -}}
{{- range $i, $path := $paths }}
{{- if eq $.part "mounts" }}
- name: pod-cgroups-{{ $i }}
  mountPath: /host{{ $path }}
{{- else }}
- name: pod-cgroups-{{ $i }}
  hostPath:
    path: {{ $path }}
    type: Directory
{{- end }}
{{- end }}
{{- end -}}

{{/*
vgpu.nodePrivileged: "true" where the node's plugins run privileged: they load NVML from the
driver root and open the cards' device nodes themselves (driver.inject plugin or cdi), or mount
each container's tmpfs folder on the host (devicePlugin.containerFolder tmpfs, the default).
*/}}
{{- define "vgpu.nodePrivileged" -}}
{{- if or (include "vgpu.driverRoot" .) (eq (dig "containerFolder" "tmpfs" .Values.devicePlugin) "tmpfs") -}}true{{- end -}}
{{- end -}}

{{/* vgpu.driverRoot: "true" where the node's plugins mount driver.root (driver.inject plugin or cdi). */}}
{{- define "vgpu.driverRoot" -}}
{{- if ne .Values.driver.inject "runtime" -}}true{{- end -}}
{{- end -}}
