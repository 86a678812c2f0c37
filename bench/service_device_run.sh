#!/usr/bin/env bash
# The service benchmark and the fast path's GPU tests in one device call, from the project root:
#     source .deps/device-env.sh; bash bench/service_device_run.sh OUT_DIR [COMMIT]
# 1. `moe-serve bench service` (DeepSeek-V3-sized and demo layers, hey, graphs, batching off,
#    h11+asyncio, the load generator's capacity) -> OUT_DIR/service/{service.json,service.md,
#    server-logs.tgz}
#    (no part starts after SERVICE_BENCH_BUDGET_S, default 300 s);
# 2. the GPU tests of the fast path in the time left of SERVICE_RUN_SECONDS (default 510 s)
#    -> OUT_DIR/gpu-tests.log;
# then prints the tests' summary and the benchmark's tables, the targets last.
set -uo pipefail
out=${1:?usage: bench/service_device_run.sh OUT_DIR [COMMIT]}
commit=${2:-}
mkdir -p "$out/service"
export PYTHONUNBUFFERED=1
{ nvidia-smi; command -v hey; python3 -c 'import httptools, uvloop' && echo "httptools+uvloop"; } \
  >"$out/environment.txt" 2>&1
python3 -m moe_serve.service.cli bench service --out "$out/service" \
  --budget-s "${SERVICE_BENCH_BUDGET_S:-300}" ${commit:+--commit "$commit"} \
  >"$out/service-bench.log" 2>&1
echo "bench service exited with $?" >>"$out/service-bench.log"
left=$(( ${SERVICE_RUN_SECONDS:-510} - SECONDS ))
if [ "$left" -gt 30 ]; then
  timeout "$left" python3 -m pytest -v -m gpu -p no:cacheprovider \
    tests/kernels/test_layer_graphs_gpu.py tests/service/test_gpu.py >"$out/gpu-tests.log" 2>&1
  echo "gpu tests exited with $? after $SECONDS s" >>"$out/gpu-tests.log"
else
  echo "gpu tests skipped: no time left after the benchmark ($SECONDS s)" >"$out/gpu-tests.log"
fi
# At most a few files come back from a device call: the servers' logs travel as one archive.
(cd "$out/service" && tar czf server-logs.tgz --remove-files ./*.log 2>/dev/null)
echo "== gpu tests"
grep -E "FAILED|ERROR|passed|exited|skipped:" "$out/gpu-tests.log" | grep -v PASSED | tail -n 25; grep -c PASSED "$out/gpu-tests.log"
echo "== bench service ($SECONDS s in all)"
grep -E "Traceback|Error|exited" "$out/service-bench.log" | tail -n 5
cat "$out/service/service.md" 2>/dev/null || tail -n 40 "$out/service-bench.log"
