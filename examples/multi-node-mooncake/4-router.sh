#!/usr/bin/env bash
# The kvcentric router (on ROUTER_HOST) in front of both instances; it asks the same
# Mooncake Store which prefixes exist.
set -euo pipefail
cd "$(dirname "$0")"; source ./env.sh
cfg="$(mktemp --suffix=.yaml)"
sed -e "s|@MODEL@|$MODEL|; s|@ROUTER_HOST@|$ROUTER_HOST|; s|@ROUTER_PORT@|$ROUTER_PORT|" \
    -e "s|@ENGINE1@|http://$ENGINE1_HOST:$ENGINE1_PORT|; s|@ENGINE2@|http://$ENGINE2_HOST:$ENGINE2_PORT|" \
    -e "s|@MASTER@|$MASTER_HOST:$MASTER_PORT|; s|@METADATA@|$METADATA|" router.yaml.in > "$cfg"
export MC_TCP_BIND_ADDRESS="${MC_TCP_BIND_ADDRESS:-$ROUTER_HOST}"  # as in 3-vllm.sh
exec $PY -m kvcentric.router.cli serve --config "$cfg" "$@"
