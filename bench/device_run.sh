#!/usr/bin/env bash
# Both benchmarks in one call on a GPU host, from the project root:
#     bash bench/device_run.sh OUT_DIR [COMMIT]
# 1. the service benchmark on the demo layer, 64-token binary requests, with dynamic batching
#    on (default --max-batch-tokens) and off (--max-batch-tokens 64, one request per forward)
#    -> OUT_DIR/http-batching.json, OUT_DIR/http-no-batching.json;
# 2. the kernel benchmark (every available backend, reference shapes) in the time left of
#    BENCH_TOTAL_SECONDS -> OUT_DIR/kernels.json.
# Knobs (environment): BENCH_DEVICE (cuda), BENCH_SHAPES, BENCH_TOKENS, BENCH_TOTAL_SECONDS (480),
# BENCH_HTTP_SECONDS (per concurrency level).
set -uo pipefail
out=${1:?usage: bench/device_run.sh OUT_DIR [COMMIT]}
commit=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
cli=(python3 -m moe_serve.service.cli)
port=8765
url=http://127.0.0.1:$port

wait_ready() {  # up to 180 s for the demo layers to load and warm up
  python3 - "$url" <<'PY'
import sys, time, httpx
deadline = time.monotonic() + 180
while time.monotonic() < deadline:
    try:
        if httpx.get(sys.argv[1] + "/ready", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit("server not ready after 180 s")
PY
}

for mode in batching no-batching; do
  extra=()
  [ "$mode" = no-batching ] && extra=(--max-batch-tokens 64)
  "${cli[@]}" serve --device "${BENCH_DEVICE:-cuda}" --port $port --log-level warning "${extra[@]}" \
    >>"$out/serve.log" 2>&1 &
  server=$!
  if wait_ready; then
    "${cli[@]}" bench http --url "$url" --layer demo --tokens 64 --concurrency 1,16,64,256 --processes 8 \
      --duration "${BENCH_HTTP_SECONDS:-4}" --out "$out/http-$mode.json" 2>&1 \
      | tee -a "$out/http.log"
  else
    echo "service ($mode) did not get ready; see serve.log" | tee -a "$out/http.log"
  fi
  kill "$server"
  wait "$server"
done

shapes=${BENCH_SHAPES:-deepseek-v3,gpt-oss,qwen3,mixtral,mixtral-fp8}
kernels() {  # kernels SHAPES OUT_JSON SECONDS
  "${cli[@]}" bench kernels --device "${BENCH_DEVICE:-cuda}" --shapes "$1" \
    --tokens "${BENCH_TOKENS:-1,8,64,512,4096}" --budget-ms 50 --max-iters 30 \
    --max-minutes "$(python3 -c "print($3 / 60)")" ${commit:+--commit "$commit"} --out "$2" 2>&1 \
    | tee -a "$out/kernels.log"
  return "${PIPESTATUS[0]}"
}
# what is left of the whole run's budget, after the service benchmark (whose servers' start-up
# compiles kernels for a time no flag bounds)
budget_s=$(( ${BENCH_TOTAL_SECONDS:-480} - SECONDS ))
[ "$budget_s" -lt 60 ] && budget_s=60
if ! kernels "$shapes" "$out/kernels.json" "$budget_s"; then
  # A crash (a sticky CUDA error poisons the process) loses only the shape it happened in:
  # the file holds every shape finished before it; run the ones after it in a fresh process.
  rest=$(python3 - "$out/kernels.json" "$shapes" <<'PY'
import json, sys
done = set()
try:
    done = {s["name"] for s in json.load(open(sys.argv[1]))["shapes"]}
except (OSError, ValueError, KeyError):
    pass
todo = [s for s in sys.argv[2].split(",") if s not in done]
print(",".join(todo[1:]))  # todo[0] is the shape that crashed
PY
)
  left=$(( ${BENCH_TOTAL_SECONDS:-480} - SECONDS ))
  if [ -n "$rest" ] && [ "$left" -gt 30 ]; then
    echo "kernel benchmark crashed; running the remaining shapes $rest" | tee -a "$out/kernels.log"
    kernels "$rest" "$out/kernels-2.json" "$left"
  fi
fi

for f in "$out"/kernels*.json; do "${cli[@]}" bench summary "$f"; done
