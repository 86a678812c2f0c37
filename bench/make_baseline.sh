#!/usr/bin/env bash
# A copy of COMMIT's code in DIR (default .baseline/, git-ignored through .git/info/exclude), to
# time that tree beside the working tree in one device call (the device copy has no git history):
#     bash bench/make_baseline.sh COMMIT [DIR]
# then carry DIR and run e.g. `cd .baseline && python3 -m moe_serve.bench.layer_profile ...` there (the
# working directory comes first on the path). Bench modules newer than COMMIT are copied in, so
# they run against its code.
set -euo pipefail
commit=${1:?usage: bench/make_baseline.sh COMMIT [DIR]}
dir=${2:-.baseline}
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >>"$exclude"
rm -rf "$dir"
mkdir -p "$dir"
git archive "$commit" kernels service weights bench pyproject.toml | tar -x -C "$dir"
rm -rf "$dir/bench/results"
for f in bench/*.py; do
  [ -e "$dir/$f" ] || cp "$f" "$dir/$f"
done
git rev-parse --short "$commit" >"$dir/COMMIT"
echo "$dir: $(cat "$dir/COMMIT") ($(du -sh "$dir" | cut -f1)); carry it to the device"
