#!/usr/bin/env bash
# A storage-only node (on NODE_HOST): contributes SEGMENT bytes of DRAM to the pool.
# Start one per machine that lends memory; engines are pure clients.
set -euo pipefail
cd "$(dirname "$0")"; source ./env.sh
exec $KVC_STORE mooncake-node --segment "$SEGMENT" --master "$MASTER_HOST:$MASTER_PORT" \
  --metadata "$METADATA" --protocol "$PROTOCOL" --hostname "$NODE_HOST" "$@"
