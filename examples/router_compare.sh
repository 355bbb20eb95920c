#!/usr/bin/env bash
# Prefix-aware routing against round-robin, on one machine: 4 kernelsight replicas publishing KV-cache events, each
# with a GPU cache too small for the histories of the sessions it serves and a KV-offloading tier in host memory,
# examples/prefix_router.py in front of them, and the same multi-turn workload (another seed per policy, so the
# second run does not meet the first one's prompts) sent through the router once per policy. Prints each run's
# prefix-cache hit rate by turn. Offline; run from the repository root:
#   bash examples/router_compare.sh
# Ports: REPLICA_PORT..+3 (HTTP), KV_PORT..+3 (KV events), ROUTER_PORT. Workload size: SESSIONS, CONCURRENCY, TURNS.
# Each replica's GPU holds GPU_BLOCKS blocks of 16 tokens; OFFLOAD_GIB > 0 adds a KV-offloading tier of that many GiB
# in host memory (vLLM's native OffloadingConnector), whose blocks the router counts too.
set -euo pipefail

REPLICA_PORT=${REPLICA_PORT:-8001}
KV_PORT=${KV_PORT:-5557}
ROUTER_PORT=${ROUTER_PORT:-8080}
SESSIONS=${SESSIONS:-32}
CONCURRENCY=${CONCURRENCY:-32}
TURNS=${TURNS:-4}
OUT=${OUT:-.}
GPU_BLOCKS=${GPU_BLOCKS:-520}
OFFLOAD_GIB=${OFFLOAD_GIB:-4}
offload=()
if [ "$OFFLOAD_GIB" != 0 ]; then offload=(--kv-offloading-size "$OFFLOAD_GIB" --kv-offloading-backend native); fi

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

wait_for() {   # URL: up to 60 s
    for _ in $(seq 240); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.25; done
    echo "router_compare: $1 did not come up" >&2; return 1
}

kernelsight serve --replicas 4 --port "$REPLICA_PORT" --max-model-len 8192 --time-scale 4 \
    --enable-prompt-tokens-details --num-gpu-blocks-override "$GPU_BLOCKS" "${offload[@]}" \
    --kv-events-config "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:$KV_PORT\", \"topic\": \"kv\"}" \
    >"$OUT/router_compare_serve.log" 2>&1 &
pids+=($!)
replicas=()
for i in 0 1 2 3; do
    wait_for "http://127.0.0.1:$((REPLICA_PORT + i))/health"
    replicas+=(--replica "http://127.0.0.1:$((REPLICA_PORT + i))")
done

seed=1
for policy in round-robin prefix; do
    python "$(dirname "$0")/prefix_router.py" "${replicas[@]}" --policy "$policy" --port "$ROUTER_PORT" \
        >"$OUT/router_compare_$policy.log" 2>&1 &
    router=$!
    pids+=("$router")
    wait_for "http://127.0.0.1:$ROUTER_PORT/router/stats"
    echo "== $policy"
    kernelsight bench --base-url "http://127.0.0.1:$ROUTER_PORT" --endpoint /v1/completions --time-scale 4 \
        --num-sessions "$SESSIONS" --session-concurrency "$CONCURRENCY" --session-turns-mean "$TURNS" \
        --session-turn-delay-mean 2000 --session-turn-delay-stddev 1000 --random-input-len 512 \
        --random-output-len 128 --seed "$seed" --disable-tqdm --result-json "$OUT/router_compare_$policy.json" \
        | sed -n '/^Prefix cache/,/^Client/p' | grep -v '^Client'
    kill "$router"; wait "$router" 2>/dev/null || true
    seed=$((seed + 1))
done
