# Hosts and ports of the multi-node Mooncake example. Override any of them in the
# environment; the defaults put everything on one machine (run it in a private network
# namespace: ./run-one-machine.sh). In production every address is a cluster address and
# the Mooncake ports must sit behind the cluster's network policy (Mooncake listens on all
# interfaces, whatever address it is given).
: "${MASTER_HOST:=127.0.0.1}"      # mooncake_master (RPC 50051, metrics 9003, metadata 8080)
: "${MASTER_PORT:=50051}"
: "${NODE_HOST:=127.0.0.1}"        # storage node: contributes SEGMENT bytes to the pool
: "${SEGMENT:=2gb}"
: "${ENGINE1_HOST:=127.0.0.1}"     # vLLM instance 1
: "${ENGINE1_PORT:=8100}"
: "${ENGINE2_HOST:=127.0.0.1}"     # vLLM instance 2
: "${ENGINE2_PORT:=8101}"
: "${ROUTER_HOST:=127.0.0.1}"      # the kvcentric router (OpenAI API for clients)
: "${ROUTER_PORT:=8000}"
: "${PROTOCOL:=tcp}"               # tcp or rdma (rdma: NICs are discovered, see README)
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# the tiny test model: python -m kvcentric.testing.models --size tiny --out .models/tiny
: "${MODEL:=$_repo/.models/tiny}"
if [ -z "${PY:-}" ]; then
  if [ -x "$_repo/.venv/bin/python" ]; then PY="$_repo/.venv/bin/python"; else PY=python; fi
fi
# `kvcentric store ...`; `$PY -m kvcentric.store.mooncake.service` is the same commands
: "${KVC_STORE:=$PY -m kvcentric.cli store}"
export MASTER_HOST MASTER_PORT NODE_HOST SEGMENT ENGINE1_HOST ENGINE1_PORT ENGINE2_HOST \
  ENGINE2_PORT ROUTER_HOST ROUTER_PORT PROTOCOL MODEL PY KVC_STORE
METADATA="http://${MASTER_HOST}:8080/metadata"
