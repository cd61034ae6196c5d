#!/usr/bin/env bash
# The Mooncake master and its HTTP metadata server (on MASTER_HOST).
set -euo pipefail
cd "$(dirname "$0")"; source ./env.sh
exec $KVC_STORE mooncake-master --host "$MASTER_HOST" --port "$MASTER_PORT" "$@"
