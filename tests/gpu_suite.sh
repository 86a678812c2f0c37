#!/usr/bin/env bash
# The GPU suite on a CUDA machine, one pytest process per test file, three files at a time, with
# the venv that has the GPU extras active (DEVELOPERS.md, "GPU suite"):
#     bash tests/gpu_suite.sh OUT_DIR
# One process per file because tests of different files share CUDA state in one process (a
# graph of one test freed while another captures): `pytest -n 3` mixed them and failed where
# every file passes on its own. Prints a line per file and the failures; the logs go to
# OUT_DIR/gpu-logs.tgz. Exit status 1 if any file failed. GPU_SUITE_SKIP: an extended regex of
# test files to leave out (those a run has just covered, say).
set -uo pipefail
out=${1:?usage: tests/gpu_suite.sh OUT_DIR}
mkdir -p "$out"
logs=$(mktemp -d)
files=$(grep -rlE "mark\.gpu|needs_gpu" tests --include='test_*.py' | grep -v '^tests/deploy/' \
  | grep -vE "${GPU_SUITE_SKIP:-^$}" | sort)
run_file() {
  local name; name=$(echo "$1" | tr / _)
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -rf "$1" >"$logs/$name.log" 2>&1
  echo "$1 exit $? $(tail -n 1 "$logs/$name.log")"
}
export -f run_file; export logs
echo "$files" | xargs -P 3 -I{} bash -c 'run_file {}' | sort | tee "$logs/summary.txt"
grep -h -E "^FAILED|^ERROR|^E   " "$logs"/*.log | head -n 40
tar czf "$out/gpu-logs.tgz" -C "$logs" .
! grep -qv " exit 0 " "$logs/summary.txt"
