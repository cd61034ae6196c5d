#!/usr/bin/env bash
# The whole example on one machine: master, storage node, two vLLM instances and the
# router, inside a private network namespace (only loopback; Mooncake's listeners bind all
# interfaces, so they must not be reachable from outside). Then a short check: a prompt
# served by instance 1 is loaded from the store by instance 2, and the router serves it.
#   ./run-one-machine.sh            (KEEP=1 keeps everything running until Ctrl-C)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ "${KVC_IN_NETNS:-}" != 1 ]; then
  exec unshare -n env KVC_IN_NETNS=1 bash -c 'ip link set lo up && exec "$0" "$@"' \
    "$here/$(basename "$0")" "$@"
fi
cd "$here"
source ./env.sh
logs="${LOGS:-$(mktemp -d -t kvc-mooncake-XXXX)}"
echo "logs: $logs"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT

wait_for() {  # wait_for FILE PATTERN SECONDS
  for _ in $(seq "$3"); do grep -q "$2" "$1" 2>/dev/null && return 0; sleep 1; done
  echo "timed out waiting for '$2' in $1" >&2; tail -20 "$1" >&2; return 1
}
wait_http() {  # wait_http URL SECONDS [PID LOG]: gives up at once if PID exits
  for _ in $(seq "$2"); do
    $PY -c "import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" \
      2>/dev/null && return 0
    if [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null; then
      echo "the process serving $1 exited; the end of ${4:-its log}:" >&2
      tail -20 "${4:-/dev/null}" >&2; return 1
    fi
    sleep 1
  done
  echo "timed out waiting for $1" >&2; return 1
}

./1-master.sh > "$logs/master.out" 2>&1 & pids+=($!)
wait_for "$logs/master.out" "mooncake master ready" 60
./2-storage-node.sh > "$logs/node.out" 2>&1 & pids+=($!)
wait_for "$logs/node.out" "mooncake node ready" 60
./3-vllm.sh 1 > "$logs/vllm1.log" 2>&1 & pids+=($!); e1=$!
./3-vllm.sh 2 > "$logs/vllm2.log" 2>&1 & pids+=($!); e2=$!
wait_http "http://$ENGINE1_HOST:$ENGINE1_PORT/health" 600 "$e1" "$logs/vllm1.log"
wait_http "http://$ENGINE2_HOST:$ENGINE2_PORT/health" 600 "$e2" "$logs/vllm2.log"
./4-router.sh > "$logs/router.log" 2>&1 & pids+=($!)
wait_http "http://$ROUTER_HOST:$ROUTER_PORT/health" 120 "$!" "$logs/router.log"

$PY - <<'PY'
import os, random, httpx
e1 = f"http://{os.environ['ENGINE1_HOST']}:{os.environ['ENGINE1_PORT']}"
e2 = f"http://{os.environ['ENGINE2_HOST']}:{os.environ['ENGINE2_PORT']}"
router = f"http://{os.environ['ROUTER_HOST']}:{os.environ['ROUTER_PORT']}"
prompt = [random.Random(0).randrange(4, 4000) for _ in range(1100)]
def complete(url):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]
def store_hits(url):
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:external_prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
a = complete(e1)
before = store_hits(e2)
b = complete(e2)
print(f"instance 2 loaded {store_hits(e2) - before:.0f} prompt tokens from Mooncake; "
      f"same tokens: {a == b}")
assert a == b, "instance 2 answered other tokens than instance 1"
assert store_hits(e2) > before, "instance 2 loaded nothing from Mooncake"
# Through the router: a new prompt, stored by instance 1 alone (sent to it directly, so
# only the store can tell the router about it). The router must predict the hit from the
# store (its keys must name the blocks the engines stored: same block size, same layout)
# and say so, in the answer's x-kvc-hit-tokens and in its store tier counter.
def router_store_tokens():
    for line in httpx.get(router + "/metrics", timeout=10).text.splitlines():
        if line.startswith('kvc_router_predicted_hit_tokens_by_tier_total{tier="store_dram"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
# The router waits at most 0.25 s for the store's answer (later ones land in its cache):
# a first lookup on a loaded machine may come late, so up to 3 fresh prompts are tried.
for attempt in range(1, 4):
    prompt = [random.Random(attempt).randrange(4, 4000) for _ in range(1100)]
    c = complete(e1)
    stored_before = router_store_tokens()
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}
    r = httpx.post(router + "/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    hit = int(r.headers.get("x-kvc-hit-tokens", "0"))
    store_tokens = router_store_tokens() - stored_before
    same = r.json()["choices"][0]["token_ids"] == c
    print(f"via the router ({r.headers.get('x-kvc-prefill')}): predicted hit {hit} of "
          f"{len(prompt)} tokens, {store_tokens:.0f} from the store; same tokens: {same}")
    assert same, "the router's answer differs from instance 1's"
    if hit >= 1024 and store_tokens > 0:
        break
else:
    keys = httpx.get(router + "/instances", timeout=10).json()["keys"]
    raise SystemExit(f"the router predicted no store hit: its keys {keys} do not name the "
                     "blocks the engines stored")
print("ok: store hits through the router")
PY
if [ "${KEEP:-0}" = 1 ]; then echo "running; Ctrl-C stops everything"; wait; fi
