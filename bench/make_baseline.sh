#!/usr/bin/env bash
# A copy of COMMIT's code in DIR (default .baseline/, git-ignored through .git/info/exclude), to
# time that tree beside the working tree in one run on a GPU host, where a copy of the tree may
# have no git history:
#     bash bench/make_baseline.sh COMMIT [DIR]
# then run the same benchmark in both, e.g.
#     python3 -m moe_serve.service.cli bench kernels --shapes deepseek-v3 --out OUT
#     (cd .baseline && python3 -m moe_serve.service.cli bench kernels --shapes deepseek-v3 \
#         --out ../OUT --commit "$(cat COMMIT)")
# (in DIR its own code comes first on the path). Bench modules newer than COMMIT are copied in,
# so that they run against its code.
set -euo pipefail
commit=${1:?usage: bench/make_baseline.sh COMMIT [DIR]}
dir=${2:-.baseline}
exclude=$(git rev-parse --git-path info/exclude)
grep -qxF "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >>"$exclude"
rm -rf "$dir"
mkdir -p "$dir"
# the package (moe_serve/, linking the folders) where COMMIT has it
paths=$(git ls-tree --name-only "$commit" moe_serve kernels service weights bench pyproject.toml)
# shellcheck disable=SC2086  # one path a word
git archive "$commit" $paths | tar -x -C "$dir"
rm -rf "$dir/bench/results"
for f in bench/*.py; do
  [ -e "$dir/$f" ] || cp "$f" "$dir/$f"
done
git rev-parse --short "$commit" >"$dir/COMMIT"
echo "$dir: $(cat "$dir/COMMIT") ($(du -sh "$dir" | cut -f1))"
