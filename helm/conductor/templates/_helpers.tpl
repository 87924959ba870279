{{/*
Names, labels, and the pieces that must agree between the gateway and the workers: pod DNS names,
ports and the P/D connector flags are all derived here, from the same values, so switching
pdProtocol or the replica counts changes both sides at once.
*/}}

{{- define "conductor.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource name prefix; kept short because StatefulSet pod names add "-<role>-<n>". */}}
{{- define "conductor.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "conductor.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "conductor.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "root" $ "component" "gateway"). */}}
{{- define "conductor.selectorLabels" -}}
app.kubernetes.io/name: {{ include "conductor.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Does the chart run workers itself (any prefill, decode or mixed StatefulSet)? Empty: gateway-only,
     in front of a fleet given in gateway.config (instance lists, or discovery by DNS). */}}
{{- define "conductor.runsWorkers" -}}
{{- if gt (add (int .Values.prefill.replicas) (int .Values.decode.replicas) (int .Values.mixed.replicas)) 0 }}true{{ end -}}
{{- end -}}

{{/* The model the `helm test` pod asks for: gateway.config.models' first, else the served model. */}}
{{- define "conductor.smokeModel" -}}
{{- with .Values.gateway.config.models }}{{ first . }}{{ else }}{{ include "conductor.servedModel" . }}{{ end -}}
{{- end -}}

{{- define "conductor.servedModel" -}}
{{- default .Values.model.name .Values.model.servedName -}}
{{- end -}}

{{/* Are the workers SGLang engines (pdProtocol sglang) rather than vLLM? */}}
{{- define "conductor.isSglang" -}}
{{- if eq .Values.pdProtocol "sglang" }}true{{ end -}}
{{- end -}}

{{/* Does the protocol need the prefill pods' bootstrap port (mooncake, sglang)? */}}
{{- define "conductor.needsBootstrap" -}}
{{- if has .Values.pdProtocol (list "mooncake" "sglang") }}true{{ end -}}
{{- end -}}

{{/* Stable DNS name of worker pod n of a role: (dict "root" $ "role" "prefill" "index" 0). */}}
{{- define "conductor.workerHost" -}}
{{- $full := include "conductor.fullname" .root -}}
{{- printf "%s-%s-%d.%s-%s.%s.svc.%s" $full .role (int .index) $full .role .root.Release.Namespace .root.Values.clusterDomain -}}
{{- end -}}

{{- define "conductor.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:%d/0" (include "conductor.fullname" .) (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{/* Replica bounds of the gateway Deployment: the autoscaler's when it is on. */}}
{{- define "conductor.gatewayMinReplicas" -}}
{{- ternary .Values.gateway.autoscaling.minReplicas .Values.gateway.replicas .Values.gateway.autoscaling.enabled | int -}}
{{- end -}}
{{- define "conductor.gatewayMaxReplicas" -}}
{{- ternary .Values.gateway.autoscaling.maxReplicas .Values.gateway.replicas .Values.gateway.autoscaling.enabled | int -}}
{{- end -}}

{{/* The Secret holding the client API keys (existing or the chart's own); empty: no keys. */}}
{{- define "conductor.apiKeysSecretName" -}}
{{- if .Values.gateway.apiKeysSecret.name -}}
{{- .Values.gateway.apiKeysSecret.name -}}
{{- else if .Values.gateway.apiKeys -}}
{{- printf "%s-gateway-api-keys" (include "conductor.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The Secret with the admin keys (existing or the chart's own); empty: none. */}}
{{- define "conductor.adminKeysSecretName" -}}
{{- $a := .Values.gateway.adminKeys -}}
{{- if $a.existingSecret }}{{ $a.existingSecret }}{{ else if $a.keys }}{{ printf "%s-gateway-admin-keys" (include "conductor.fullname" .) }}{{ end -}}
{{- end -}}

{{/* The Secret with the upstream key (existing or the chart's own); empty: none. */}}
{{- define "conductor.upstreamKeySecretName" -}}
{{- $u := .Values.gateway.upstreamKey -}}
{{- if $u.existingSecret }}{{ $u.existingSecret }}{{ else if $u.value }}{{ printf "%s-gateway-upstream-key" (include "conductor.fullname" .) }}{{ end -}}
{{- end -}}

{{/* The gateway pods' ServiceAccount; empty: the namespace's default. */}}
{{- define "conductor.gatewayServiceAccount" -}}
{{- $sa := .Values.gateway.serviceAccount -}}
{{- if $sa.create }}{{ default (printf "%s-gateway" (include "conductor.fullname" .)) $sa.name }}{{ else }}{{ $sa.name }}{{ end -}}
{{- end -}}

{{/* gateway.apiKeys as the JSON list CONDUCTOR_AUTH__API_KEYS holds: every key a string (`--set` turns
     digits into numbers, which the gateway would refuse), valid YAML and JSON alike. */}}
{{- define "conductor.apiKeysJson" -}}
{{- $keys := list -}}
{{- range .Values.gateway.apiKeys }}{{ $keys = append $keys (toString .) }}{{ end -}}
{{- toJson $keys -}}
{{- end -}}

{{/* The admin port the gateway will listen on, read from its final settings (so gateway.config.admin_port
     counts too); empty when it serves everything on the public port. */}}
{{- define "conductor.gatewayAdminPort" -}}
{{- $port := (fromYaml (include "conductor.gatewayConfig" .)).admin_port -}}
{{- if not (kindIs "invalid" $port) }}{{ int $port }}{{ end -}}
{{- end -}}

{{/* Refuse value combinations that would render a working but wrong (or insecure) release. */}}
{{- define "conductor.validate" -}}
{{- $g := .Values.gateway -}}
{{- if or (hasKey $g.config "api_keys") (hasKey ($g.config.auth | default dict) "api_keys") -}}
{{- fail "gateway.config.auth.api_keys would put the API keys in a ConfigMap in plain text: give them as gateway.apiKeys (the chart makes a Secret) or name an existing Secret in gateway.apiKeysSecret.name" -}}
{{- end -}}
{{- if and $g.apiKeys $g.apiKeysSecret.name -}}
{{- fail "give either gateway.apiKeys or gateway.apiKeysSecret.name, not both" -}}
{{- end -}}
{{- $admin := include "conductor.gatewayAdminPort" . -}}
{{- if and $admin (eq (int $admin) (int (fromYaml (include "conductor.gatewayConfig" .)).port)) -}}
{{- fail "gateway.adminPort must differ from gateway.port" -}}
{{- end -}}
{{- if and $g.autoscaling.enabled (gt (int $g.autoscaling.minReplicas) (int $g.autoscaling.maxReplicas)) -}}
{{- fail "gateway.autoscaling.minReplicas is above maxReplicas" -}}
{{- end -}}
{{- end -}}

{{- define "conductor.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion (toString .image.tag)) -}}
{{- end -}}

{{/*
The gateway's settings (conductor/config/settings.py field names, grouped: pd.protocol, timeouts.drain_grace_s),
as YAML: every worker pod with its URL, bootstrap port (mooncake, sglang) and KV events endpoint, then
gateway.config merged over.
*/}}
{{- define "conductor.gatewayConfig" -}}
{{- $v := .Values -}}
{{- $user := $v.gateway.config | default dict -}}
{{- /* a setting gateway.config still gives by its old flat name (pd_protocol, mooncake_schema, drain_grace_s)
       is left to it: the gateway moves it to its group with a warning, and refuses a file naming it both ways */ -}}
{{- $pd := dict -}}
{{- if not (hasKey $user "pd_protocol") }}{{ $_ := set $pd "protocol" $v.pdProtocol }}{{ end -}}
{{- if and (eq $v.pdProtocol "mooncake") (not (hasKey $user "mooncake_schema")) -}}
{{- $_ := set $pd "mooncake_schema" $v.gateway.mooncakeSchema -}}
{{- end -}}
{{- $timeouts := dict -}}
{{- if not (hasKey $user "drain_grace_s") }}{{ $_ := set $timeouts "drain_grace_s" (float64 $v.gateway.drainGraceSeconds) }}{{ end -}}
{{- $cfg := dict "host" "0.0.0.0" "port" (int $v.gateway.port) "pd" $pd "timeouts" $timeouts
      "policy" $v.gateway.policy "block_size" (int $v.model.blockSize) -}}
{{- /* the served model is known only when the chart runs the workers; a gateway in front of an existing
       fleet (gateway-only) asks the workers' /v1/models, unless gateway.config.models says otherwise */ -}}
{{- if include "conductor.runsWorkers" . }}{{ $_ := set $cfg "models" (list (include "conductor.servedModel" .)) }}{{ end -}}
{{- if not (kindIs "invalid" $v.gateway.adminPort) }}{{ $_ := set $cfg "admin_port" (int $v.gateway.adminPort) }}{{ end -}}
{{- /* with client keys and no admin port, /metrics on the public port takes a key, which the scrape set up
       here (pod annotations, a ServiceMonitor on port http) does not send: it stays open for it (auth.public_metrics;
       /docs and /openapi.json still take a key). gateway.adminPort takes /metrics off the public port instead. */ -}}
{{- $scraped := or $v.monitoring.podAnnotations $v.monitoring.serviceMonitor.enabled -}}
{{- $auth := dict -}}
{{- if and (kindIs "invalid" $v.gateway.adminPort) (include "conductor.apiKeysSecretName" .) $scraped -}}
{{- $_ := set $auth "public_metrics" true -}}
{{- end -}}
{{- /* admin and upstream keys: files from Secrets (gateway.yaml mounts them), never values in this ConfigMap */ -}}
{{- if include "conductor.adminKeysSecretName" . -}}
{{- $_ := set $auth "admin_api_keys_file" (printf "/etc/conductor/secrets/admin/%s" $v.gateway.adminKeys.key) -}}
{{- end -}}
{{- if include "conductor.upstreamKeySecretName" . -}}
{{- $_ := set $auth "upstream_api_key_file" (printf "/etc/conductor/secrets/upstream/%s" $v.gateway.upstreamKey.key) -}}
{{- end -}}
{{- if $auth }}{{ $_ := set $cfg "auth" $auth }}{{ end -}}
{{- $slo := dict -}}
{{- if not (kindIs "invalid" $v.gateway.slo.ttftSeconds) }}{{ $_ := set $slo "ttft_s" (float64 $v.gateway.slo.ttftSeconds) }}{{ end -}}
{{- if not (kindIs "invalid" $v.gateway.slo.tbtSeconds) }}{{ $_ := set $slo "tbt_s" (float64 $v.gateway.slo.tbtSeconds) }}{{ end -}}
{{- if $slo }}{{ $_ := set $cfg "slo" $slo }}{{ end -}}
{{- /* discovery: each role's headless Service resolved at run time, instead of the list below */ -}}
{{- $discovery := $v.gateway.discovery.enabled -}}
{{- if $discovery -}}
{{- $sources := dict "interval_s" (float64 $v.gateway.discovery.intervalSeconds) -}}
{{- range $role := list "prefill" "decode" "mixed" -}}
{{- if gt (int (index $v $role).replicas) 0 -}}
{{- $full := include "conductor.fullname" $ -}}
{{- $src := dict "name" (printf "%s-%s.%s.svc.%s" $full $role $.Release.Namespace $v.clusterDomain) "port" (int $v.workers.port) -}}
{{- if and (eq $role "prefill") (include "conductor.needsBootstrap" $) -}}
{{- $_ := set $src "bootstrap_port" (int $v.workers.bootstrapPort) -}}
{{- end -}}
{{- if and $v.workers.kvEvents.enabled $v.gateway.subscribeKvEvents (ne $role "decode") -}}
{{- $_ := set $src "kv_events_port" (int $v.workers.kvEvents.port) -}}
{{- end -}}
{{- $_ := set $sources $role $src -}}
{{- end -}}
{{- end -}}
{{- $_ := set $cfg "discovery" $sources -}}
{{- end -}}
{{- range $role := list "prefill" "decode" "mixed" -}}
{{- if not $discovery -}}
{{- $specs := list -}}
{{- range $i := until (int (index $v $role).replicas) -}}
{{- $host := include "conductor.workerHost" (dict "root" $ "role" $role "index" $i) -}}
{{- $spec := dict "name" (printf "%s-%d" $role $i) "url" (printf "http://%s:%d" $host (int $v.workers.port)) -}}
{{- if and (eq $role "prefill") (include "conductor.needsBootstrap" $) -}}
{{- $_ := set $spec "bootstrap_port" (int $v.workers.bootstrapPort) -}}
{{- end -}}
{{- if and $v.workers.kvEvents.enabled $v.gateway.subscribeKvEvents (ne $role "decode") -}}
{{- /* the endpoint exactly as the engine has it: "*" means the engine binds and the gateway connects
       to the instance's host (vLLM's rule), which is what lets every gateway replica subscribe */ -}}
{{- $_ := set $spec "kv_events_endpoint" (printf "tcp://*:%d" (int $v.workers.kvEvents.port)) -}}
{{- end -}}
{{- $specs = append $specs $spec -}}
{{- end -}}
{{- if $specs }}{{ $_ := set $cfg $role $specs }}{{ end -}}
{{- end -}}
{{- end -}}
{{- $kv := $v.gateway.kv -}}
{{- $redisUrl := include "conductor.redisUrl" . -}}
{{- $index := $kv.index -}}
{{- if eq $index "auto" }}{{ $index = ternary "redis" "memory" (ne $redisUrl "") }}{{ end -}}
{{- $kvCfg := dict "enabled" $kv.enabled "tokenizer" $kv.tokenizer "index" $index "max_blocks" (int $kv.maxBlocks) -}}
{{- if eq $index "redis" }}{{ $_ := set $kvCfg "redis_url" $redisUrl }}{{ end -}}
{{- if and $discovery (has (toString $kv.tokenizer) (list "worker" "auto")) -}}
{{- /* no instance is listed at start-up to take /tokenize from: the Service's name stands for its pods.
       Only a Service the chart makes (a prefill or mixed StatefulSet runs); otherwise the user's own
       discovery source, below, once gateway.config is merged */ -}}
{{- $tokRole := ternary "mixed" "prefill" (eq (int $v.prefill.replicas) 0) -}}
{{- if gt (int (index $v $tokRole).replicas) 0 -}}
{{- $_ := set $kvCfg "tokenizer_url" (printf "http://%s-%s.%s.svc.%s:%d" (include "conductor.fullname" .) $tokRole .Release.Namespace $v.clusterDomain (int $v.workers.port)) -}}
{{- end -}}
{{- end -}}
{{- if $kv.mooncakeStore -}}
{{- $m := $v.mooncakeMaster -}}
{{- $master := printf "%s-mooncake-master" (include "conductor.fullname" .) -}}
{{- $meta := ternary (printf "http://%s:%d/metadata" $master (int $m.httpMetadataServer.port)) "P2PHANDSHAKE" $m.httpMetadataServer.enabled -}}
{{- $_ := set $kvCfg "mooncake" (dict "master" (printf "%s:%d" $master (int $m.rpcPort)) "metadata_server" $meta "model" (include "conductor.servedModel" .)) -}}
{{- /* store objects are named by vLLM's own block hashes */ -}}
{{- $_ := set $kvCfg "key_mode" "vllm" -}}
{{- end -}}
{{- $_ := set $cfg "kv" $kvCfg -}}
{{- $merged := mustMergeOverwrite $cfg (deepCopy $v.gateway.config) -}}
{{- /* gateway-only by DNS: the worker tokenizer asks the user's prefill (or mixed) Service, the one
       name that stands for the fleet's pods before any is resolved */ -}}
{{- $mkv := $merged.kv -}}
{{- if and (has (toString $mkv.tokenizer) (list "worker" "auto")) (not $mkv.tokenizer_url) (not $merged.prefill) (not $merged.mixed) -}}
{{- $d := $merged.discovery | default dict -}}
{{- $src := $d.prefill | default $d.mixed -}}
{{- if and $src $src.name $src.port -}}
{{- $_ := set $mkv "tokenizer_url" (printf "%s://%s:%d" ($src.scheme | default "http") $src.name (int $src.port)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $merged -}}
{{- end -}}

{{/* --kv-transfer-config JSON of a vLLM worker role (prefill: kv_producer, decode: kv_consumer). */}}
{{- define "conductor.kvTransferConfig" -}}
{{- $v := .root.Values -}}
{{- $connector := ternary "NixlConnector" "MooncakeConnector" (eq $v.pdProtocol "nixl") -}}
{{- $cfg := dict "kv_connector" $connector "kv_role" (ternary "kv_producer" "kv_consumer" (eq .role "prefill")) -}}
{{- if $v.workers.kvBufferDevice }}{{ $_ := set $cfg "kv_buffer_device" $v.workers.kvBufferDevice }}{{ end -}}
{{- if $v.workers.kvConnectorExtraConfig }}{{ $_ := set $cfg "kv_connector_extra_config" $v.workers.kvConnectorExtraConfig }}{{ end -}}
{{- toJson $cfg -}}
{{- end -}}

{{/* --kv-events-config JSON: bind the PUB socket on every interface (vLLM binds only with "*"). */}}
{{- define "conductor.kvEventsConfig" -}}
{{- $e := .Values.workers.kvEvents -}}
{{- $cfg := dict "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int $e.port)) "topic" $e.topic -}}
{{- if not (include "conductor.isSglang" .) }}{{ $_ := set $cfg "enable_kv_cache_events" true }}{{ end -}}
{{- toJson $cfg -}}
{{- end -}}

{{/* The engine's command and arguments for a role, as a YAML mapping {command: [...], args: [...]}. */}}
{{- define "conductor.workerCommand" -}}
{{- $v := .root.Values -}}
{{- $w := $v.workers -}}
{{- $args := list -}}
{{- if $w.emulator.enabled -}}
{{- /* binds the pod IP: the emulator advertises its bind address to its P/D peers */ -}}
{{- $args = list "emulate" "--role" .role "--pd-protocol" $v.pdProtocol "--host" "$(POD_IP)"
      "--port" (toString $w.port) "--model" (include "conductor.servedModel" .root)
      "--block-size" (toString $v.model.blockSize) "--engine-id" "$(POD_NAME)"
      "--time-scale" (toString $w.emulator.timeScale) -}}
{{- if and (eq .role "prefill") (include "conductor.needsBootstrap" .root) }}{{ $args = concat $args (list "--bootstrap-port" (toString $w.bootstrapPort)) }}{{ end -}}
{{- if eq $v.pdProtocol "nixl" }}{{ $args = concat $args (list "--side-channel-port" (toString $w.nixlSideChannelPort)) }}{{ end -}}
{{- if and $w.kvEvents.enabled (ne .role "decode") -}}
{{- $args = concat $args (list "--kv-events-endpoint" (printf "tcp://*:%d" (int $w.kvEvents.port)) "--kv-events-topic" $w.kvEvents.topic) -}}
{{- end -}}
{{- $args = concat $args $w.emulator.extraArgs (index $v .role).extraArgs -}}
command: ["conductor"]
{{- else if include "conductor.isSglang" .root -}}
{{- $args = list "--model-path" $v.model.name "--host" "0.0.0.0" "--port" (toString $w.port)
      "--served-model-name" (include "conductor.servedModel" .root) "--page-size" (toString $v.model.blockSize)
      "--tp-size" (toString $w.tensorParallelSize) "--mem-fraction-static" (toString $w.gpuMemoryUtilization)
      "--enable-metrics" -}}
{{- if $v.model.maxModelLen }}{{ $args = concat $args (list "--context-length" (toString $v.model.maxModelLen)) }}{{ end -}}
{{- if ne .role "mixed" -}}
{{- $args = concat $args (list "--disaggregation-mode" .role "--disaggregation-transfer-backend" $w.sglang.transferBackend) -}}
{{- if eq .role "prefill" }}{{ $args = concat $args (list "--disaggregation-bootstrap-port" (toString $w.bootstrapPort)) }}{{ end -}}
{{- end -}}
{{- if and $w.kvEvents.enabled (ne .role "decode") }}{{ $args = concat $args (list "--kv-events-config" (include "conductor.kvEventsConfig" .root)) }}{{ end -}}
{{- $args = concat $args $w.sglang.extraArgs (index $v .role).extraArgs -}}
command: ["python3", "-m", "sglang.launch_server"]
{{- else -}}
{{- $args = list $v.model.name "--host" "0.0.0.0" "--port" (toString $w.port)
      "--served-model-name" (include "conductor.servedModel" .root) "--block-size" (toString $v.model.blockSize)
      "--tensor-parallel-size" (toString $w.tensorParallelSize)
      "--gpu-memory-utilization" (toString $w.gpuMemoryUtilization) -}}
{{- if $w.enablePrefixCaching }}{{ $args = append $args "--enable-prefix-caching" }}{{ end -}}
{{- if $v.model.maxModelLen }}{{ $args = concat $args (list "--max-model-len" (toString $v.model.maxModelLen)) }}{{ end -}}
{{- if ne .role "mixed" -}}
{{- $args = concat $args (list "--kv-transfer-config" (include "conductor.kvTransferConfig" .)) -}}
{{- end -}}
{{- if and $w.kvEvents.enabled (ne .role "decode") }}{{ $args = concat $args (list "--kv-events-config" (include "conductor.kvEventsConfig" .root)) }}{{ end -}}
{{- $args = concat $args $w.vllm.extraArgs (index $v .role).extraArgs -}}
command: ["vllm", "serve"]
{{- end }}
args:
{{- toYaml $args | nindent 2 }}
{{- end -}}

{{/* Connector environment of a role: pod IP for the transfer engines, bootstrap / side channel ports. */}}
{{- define "conductor.workerEnv" -}}
{{- $v := .root.Values -}}
- name: POD_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: POD_NAME
  valueFrom: {fieldRef: {fieldPath: metadata.name}}
- name: HF_HOME
  value: {{ $v.workers.modelMountPath | quote }}
{{- if not (or (include "conductor.isSglang" .root) $v.workers.emulator.enabled) }}
- name: VLLM_HOST_IP
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
{{- if and (eq $v.pdProtocol "mooncake") (eq .role "prefill") }}
- name: VLLM_MOONCAKE_BOOTSTRAP_PORT
  value: {{ $v.workers.bootstrapPort | quote }}
{{- end }}
{{- if and (eq $v.pdProtocol "nixl") (ne .role "mixed") }}
- name: VLLM_NIXL_SIDE_CHANNEL_HOST
  valueFrom: {fieldRef: {fieldPath: status.podIP}}
- name: VLLM_NIXL_SIDE_CHANNEL_PORT
  value: {{ $v.workers.nixlSideChannelPort | quote }}
{{- end }}
{{- end }}
{{- with $v.workers.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}
