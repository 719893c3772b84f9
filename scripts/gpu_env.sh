# Source this on a GPU machine that has no network access, from the repository root, to use the
# checkout in place (no install): wheels carried in ./.whl (if any) go to /tmp/site, and the
# top-level areas are linked into lockserve/ (lockserve/kernels -> ../kernels, ...; git ignores
# the links), which is what the install's package-dir mapping does.
#   source scripts/gpu_env.sh && python -m pytest -m gpu tests
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# Staged by scripts/device_stage.sh: the model's parts and the essays, all but the last part copied
# to /tmp/stage by earlier calls; the last part is carried by this call.
if ls .carry/*/model.part.* >/dev/null 2>&1 && [ -d /tmp/stage ]; then
  for part in .carry/*/model.part.*; do
    [ -e "/tmp/stage/$(basename "$part")" ] || cp "$part" /tmp/stage/
  done
fi
if [ -f /tmp/stage/model.parts ] && [ ! -f /tmp/stage/model.gguf ]; then
  parts=$(cat /tmp/stage/model.parts)
  if [ "$(ls /tmp/stage/model.part.* | wc -l)" = "$parts" ]; then
    for ((i = 0; i < parts; i++)); do cat "/tmp/stage/model.part.$i"; done > /tmp/stage/model.gguf
  else
    echo "gpu_env.sh: /tmp/stage holds $(ls /tmp/stage/model.part.* | wc -l) of $parts model parts" >&2
  fi
fi
if [ -f /tmp/stage/PaulGrahamEssays.json.gz ] && [ ! -f /tmp/stage/PaulGrahamEssays.json ]; then
  gzip -dc /tmp/stage/PaulGrahamEssays.json.gz > /tmp/stage/PaulGrahamEssays.json
fi
if [ -f /tmp/stage/PaulGrahamEssays.json ]; then  # copied there by the first call
  export LOCKSERVE_HAYSTACK=/tmp/stage/PaulGrahamEssays.json
fi
for area in kernels offload workers cluster configs; do ln -sfn "../$area" "lockserve/$area"; done
export PYTHONPATH="/tmp/site:$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
