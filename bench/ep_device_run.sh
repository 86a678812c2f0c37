#!/usr/bin/env bash
# Issue 20's GPU run in one device call on two GPUs (nvidia-h100-x2 / nvidia-h200-x2), from the
# project root:
#     source .deps/device-env.sh; bash bench/ep_device_run.sh OUT_DIR
# 1. `python3 -m moe_serve.bench.ep_service` (DeepSeek-V3-sized layer, service mode, EP 2 against one GPU)
#    once per backend of EP_BACKENDS (default "triton deep-gemm") and placement file of
#    EP_PLACEMENTS (default: the even placement), each within EP_BENCH_SECONDS (180)
#    -> OUT_DIR/ep_service-TAG.{md,json}, OUT_DIR/ep-bench-TAG.log (TAG: the backend, then the
#    placement file's name); the first placement of each backend with --profile: every rank's
#    kernel tables and traces at the largest M in OUT_DIR/profiles-TAG.tgz, the ranks side by
#    side in OUT_DIR/ep-timeline-TAG.md (bench.ep_timeline). EP_BASELINE (a tree that
#    bench/make_baseline.sh wrote, carried along): the same first run from that tree before it,
#    TAG-baseline, so that an A/B is within one call. The 11 GB layer directory is written under
#    a temporary directory, not OUT_DIR;
# 2. `tests/service/test_ep_gpu.py` (serve --ep 2 over NCCL with graphs, a killed rank)
#    -> OUT_DIR/ep-service-tests.log;
# 3. `tests/kernels/test_naive_ep.py -m gpu` (every expert-map backend over two GPUs against one)
#    in the time left of EP_RUN_SECONDS (default 560) -> OUT_DIR/ep-kernel-tests.log.
# EP_TESTS=0: step 1 alone; EP_BENCH_ARGS: more arguments of bench.ep_service (--tokens 4096,
# --inputs pinned). For example, on a tree against f1e57b9 at two placements:
#     bash bench/make_baseline.sh f1e57b9   # here, then carry .baseline
#     EP_TESTS=0 EP_BACKENDS=triton EP_BASELINE=.baseline EP_BENCH_ARGS="--inputs pinned" \
#       EP_PLACEMENTS="bench/placements/deepseek-v3-ep2-116-140.json \
#       bench/placements/deepseek-v3-ep2-124-132.json" bash bench/ep_device_run.sh OUT_DIR
# Each step has its own time limit; ranks a killed step left behind are killed before the next.
# The logs, tables and environment.txt end up in OUT_DIR/ep-logs.tgz, the JSON files in
# OUT_DIR/ep-service-json.tgz (the device tool brings back eight files); summaries are printed.
set -uo pipefail
out=${1:?usage: bench/ep_device_run.sh OUT_DIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
# KINDS.md: NVLink multicast stays off, also in every process this starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
total=${EP_RUN_SECONDS:-560}
{ nvidia-smi; nvidia-smi topo -m; } >"$out/environment.txt" 2>&1  # the device copy has no reliable git history

leftovers() {  # ranks of a step its timeout killed (spawned children outlive a SIGKILLed parent)
  pkill -9 -f "multiprocessing.spawn" 2>/dev/null
  sleep 1
}

bench() {  # BACKEND TAG TREE PLACEMENT PROFILE: one bench.ep_service run -> OUT_DIR/*-TAG.*
  local backend=$1 tag=$2 tree=$3 placement=$4 profile=$5 work
  local args=(--backend "$backend" --seconds 2)
  [ "$placement" = even ] || args+=(--placement "$(realpath "$placement")")
  [ "$profile" = 1 ] && args+=(--profile)
  work=$(mktemp -d)
  (cd "$tree" && timeout -k 5 "${EP_BENCH_SECONDS:-180}" python3 -m moe_serve.bench.ep_service \
    --out "$work" "${args[@]}" ${EP_BENCH_ARGS:-}) >"$out/ep-bench-$tag.log" 2>&1
  echo "bench.ep_service exited with $? after $SECONDS s" >>"$out/ep-bench-$tag.log"
  cp "$work"/ep_service.md "$out/ep_service-$tag.md" 2>/dev/null
  cp "$work"/ep_service.json "$out/ep_service-$tag.json" 2>/dev/null
  if [ "$profile" = 1 ]; then
    # the ranks side by side, and every rank's kernel tables and traces in one file (the device
    # tool brings back few files per call)
    python3 -m moe_serve.bench.ep_timeline "$work" >>"$out/ep-bench-$tag.log" 2>&1 \
      && cp "$work/ep-timeline.md" "$out/ep-timeline-$tag.md"
    (cd "$work" && ls profile-*.txt >/dev/null 2>&1 \
      && tar czf "$out/profiles-$tag.tgz" profile-*.txt profile-*.trace.json)
  fi
  rm -rf "$work"
  leftovers
}

tags=()
for backend in ${EP_BACKENDS:-triton deep-gemm}; do
  first=1
  for placement in ${EP_PLACEMENTS:-even}; do
    name=$backend
    [ "$placement" = even ] || name=$backend-$(basename "$placement" .json)
    if [ "$first" = 1 ] && [ -n "${EP_BASELINE:-}" ]; then  # the A/B within this call
      bench "$backend" "$name-baseline" "$EP_BASELINE" "$placement" 0
      tags+=("$name-baseline")
    fi
    bench "$backend" "$name" . "$placement" "$first"  # profiled once per backend
    tags+=("$name")
    first=0
  done
done

if [ "${EP_TESTS:-1}" = 0 ]; then  # the benchmark alone
  echo "skipped: EP_TESTS=0" | tee "$out/ep-service-tests.log" >"$out/ep-kernel-tests.log"
else
  service_s=${EP_SERVICE_TEST_SECONDS:-150}
  # progress as it goes, and every thread's stack 10 s before the step's limit: a hang shows where
  timeout -k 5 "$service_s" python3 -m pytest -v -m gpu -p no:cacheprovider \
    -o log_cli=true --log-cli-level=INFO -o faulthandler_timeout=$((service_s - 10)) \
    tests/service/test_ep_gpu.py >"$out/ep-service-tests.log" 2>&1
  echo "service EP tests exited with $? after $SECONDS s" >>"$out/ep-service-tests.log"
  leftovers

  left=$((total - SECONDS))
  if [ "$left" -gt 30 ]; then
    timeout -k 5 "$left" python3 -m pytest -v -m gpu -p no:cacheprovider \
      tests/kernels/test_naive_ep.py -o log_cli=true --log-cli-level=INFO \
      >"$out/ep-kernel-tests.log" 2>&1
    echo "kernel EP tests exited with $? after $SECONDS s" >>"$out/ep-kernel-tests.log"
    leftovers
  else
    echo "kernel EP tests skipped: no time left ($SECONDS s)" >"$out/ep-kernel-tests.log"
  fi
fi

for log in ep-service-tests ep-kernel-tests; do
  echo "== $log"
  grep -E "FAILED|ERROR|passed|failed|exited|skipped" "$out/$log.log" | grep -v PASSED | tail -n 12
done
for tag in "${tags[@]}"; do
  echo "== bench.ep_service $tag"
  grep -E "Traceback|Error|exited" "$out/ep-bench-$tag.log" | tail -n 6
  cat "$out/ep_service-$tag.md" 2>/dev/null || tail -n 30 "$out/ep-bench-$tag.log"
  cat "$out/ep-timeline-$tag.md" 2>/dev/null
done
# few files: the device tool brings back only eight a call (the tables were printed above)
(cd "$out" && tar czf ep-logs.tgz environment.txt ./*.log ./*.md \
  && tar czf ep-service-json.tgz ./ep_service-*.json \
  && rm -f environment.txt ./*.log ./*.md ./ep_service-*.json)
