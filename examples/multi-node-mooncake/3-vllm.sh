#!/usr/bin/env bash
# vLLM instance 1 or 2 (on ENGINE<n>_HOST) with the kvcentric connector on the mooncake
# backend, as a pure Mooncake client: ./3-vllm.sh 1   ./3-vllm.sh 2
set -euo pipefail
cd "$(dirname "$0")"; source ./env.sh
n="${1:?usage: $0 1|2}"; shift
host_var="ENGINE${n}_HOST"; port_var="ENGINE${n}_PORT"
host="${!host_var}"; port="${!port_var}"
kv=$(cat <<JSON
{"kv_connector": "KVCentricConnector", "kv_connector_module_path": "kvcentric.connector.vllm",
 "kv_role": "kv_both", "kv_connector_extra_config": {"store": {"backend": "mooncake",
 "mooncake": {"master_server_address": "$MASTER_HOST:$MASTER_PORT", "metadata_server": "$METADATA",
              "protocol": "$PROTOCOL", "local_hostname": "$host", "global_segment_size": 0}}}}
JSON
)
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# Mooncake's transfer engine binds its listener to the first non-loopback address unless
# told; bind it to the address the connector advertises (local_hostname), which the
# connector requires of a loopback one
export MC_TCP_BIND_ADDRESS="${MC_TCP_BIND_ADDRESS:-$host}"
exec $PY -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name tiny \
  --host "$host" --port "$port" --dtype float32 --max-model-len 4096 --enforce-eager \
  --kv-transfer-config "$kv" "$@"
