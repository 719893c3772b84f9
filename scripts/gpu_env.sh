# Source this on a GPU machine that has no network access, from the repository root, to use the
# checkout in place (no install): wheels carried in ./.whl (if any) go to /tmp/site, and the
# top-level areas are linked into lockserve/ (lockserve/kernels -> ../kernels, ...; git ignores
# the links), which is what the install's package-dir mapping does.
#   source scripts/gpu_env.sh && python -m pytest -m gpu tests
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# Staged by scripts/device_stage.sh: the model's two halves and the essays (the first half and the
# essays copied to /tmp/stage by an earlier call).
if [ -f .carry/b/model.part.b ] && [ -f /tmp/stage/model.part.a ] && [ ! -f /tmp/stage/model.gguf ]; then
  cat /tmp/stage/model.part.a .carry/b/model.part.b > /tmp/stage/model.gguf
fi
if [ -f /tmp/stage/PaulGrahamEssays.json ]; then  # copied there by the first call
  export LOCKSERVE_HAYSTACK=/tmp/stage/PaulGrahamEssays.json
fi
for area in kernels offload workers cluster configs; do ln -sfn "../$area" "lockserve/$area"; done
export PYTHONPATH="/tmp/site:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
