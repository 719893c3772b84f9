#!/usr/bin/env bash
# Same-machine A/B of commits: a benchmark run at several commits in one device call, so that a
# ratio between commits never mixes two machines (docs/notes/prefill.md: two H100s differed by
# up to 2x on host-bound steps and disk writes).
#
# Here (stage; each tree is the packages only, ~2 MB, in the git-ignored .carry/ab/SHA; after
# scripts/device_stage.sh, which empties .carry):
#   bash scripts/ab_trees.sh stage a3c37b7 b86c156
# On the device machine, after `source scripts/gpu_env.sh` (carry ".carry/ab" and ".whl"):
#   bash scripts/ab_trees.sh run 2 -- python -m lockserve.cluster.measure bench prefill \
#       --contexts 32K --modes locks:hbm locks:host+nvme --out '$OUT' --name 'ab_{sha}_{round}'
# `run ROUNDS` runs the command ROUNDS times for each staged tree and for the checkout itself
# (named by LOCKSERVE_COMMIT, else `head`), alternating trees within a round (base, head, base,
# head, ...: a machine's drift does not fall on one side). {sha} and {round} in the command's
# arguments become the tree's name and the round, and a literal $OUT the device's output folder;
# each tree runs with LOCKSERVE_COMMIT set to it. AB_DIR: where trees are staged (.carry/ab).
# The device tool brings back at most 8 files a call: a bench writes four a run (JSON, CSV, markdown,
# PNG), so end the call with `rm -f $OUT/*.csv $OUT/*.md $OUT/*.png` (the JSON holds every figure),
# or two trees in two rounds come back as one tree's files.
set -euo pipefail
self=$(realpath "$0")
cd "$(dirname "$self")/.."
areas=(lockserve kernels offload workers cluster configs)
ab_dir=$(realpath -m "${AB_DIR:-.carry/ab}")

stage() {
  [ $# -gt 0 ] || { echo "stage: name at least one commit" >&2; exit 2; }
  for ref in "$@"; do
    sha=$(git rev-parse --short "$ref^{commit}")
    rm -rf "${ab_dir:?}/$sha" && mkdir -p "$ab_dir/$sha"
    git archive "$sha" "${areas[@]}" | tar -x -C "$ab_dir/$sha"
    echo "staged $ref as $ab_dir/$sha ($(du -sh "$ab_dir/$sha" | cut -f1))"
  done
}

run() {
  local rounds=$1
  shift
  [ "${1:-}" = "--" ] || { echo "run: ROUNDS -- COMMAND ..." >&2; exit 2; }
  shift
  local head_name=${LOCKSERVE_COMMIT:-head}
  head_name=${head_name:0:7}
  local trees=()
  for tree in "$ab_dir"/*/; do
    [ -d "$tree" ] || continue
    for area in kernels offload workers cluster configs; do ln -sfn "../$area" "$tree/lockserve/$area"; done
    trees+=("$(basename "$tree")")
  done
  [ ${#trees[@]} -gt 0 ] || { echo "run: nothing staged under $ab_dir (stage first, carry it)" >&2; exit 2; }
  for ((r = 1; r <= rounds; r++)); do
    for name in "${trees[@]}" "$head_name"; do
      local args=()
      for a in "$@"; do a=${a//\{sha\}/$name}; a=${a//\{round\}/$r}; args+=("${a//\$OUT/${OUT:-}}"); done
      echo "== round $r: $name"
      if [ "$name" = "$head_name" ]; then
        "${args[@]}"
      else
        # PYTHONSAFEPATH: python -m / -c would put the working directory (the checkout, whose
        # lockserve links gpu_env.sh makes) first on sys.path, ahead of the staged tree
        PYTHONSAFEPATH=1 PYTHONPATH="/tmp/site:$ab_dir/$name${PYTHONPATH:+:$PYTHONPATH}" \
          LOCKSERVE_COMMIT="$name" "${args[@]}"
      fi
    done
  done
}

case "${1:-}" in
  stage) shift; stage "$@" ;;
  run) shift; run "$@" ;;
  *) sed -n '2,16p' "$self" >&2; exit 2 ;;
esac
