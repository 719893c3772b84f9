"""A model's own sampling defaults: a Hugging Face generation_config.json, a GGUF's
general.sampling.* keys, the embedded SmolLM2's model-card values, none for presets."""

from __future__ import annotations

import json

import gguf
import pytest
from lockserve.workers.model.loader import default_model_path
from lockserve.workers.sampling_defaults import EMBEDDED_DEFAULTS, sampling_defaults


def test_hf_folder_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    got = sampling_defaults(str(tmp_path))
    assert {k: got[k] for k in ("temperature", "top_p", "top_k")} == {"temperature": 0.6, "top_p": 0.95,
                                                                      "top_k": 20}
    assert got["source"].endswith("generation_config.json")


def test_hf_folder_without_sampling_keys_has_none(tmp_path):
    assert sampling_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert sampling_defaults(str(tmp_path)) == {}, "bos/eos only (SmolLM2's own file): no defaults"


def test_gguf_sampling_keys(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.5)
    writer.add_int32("general.sampling.top_k", 40)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    got = sampling_defaults(str(path))
    assert got["temperature"] == pytest.approx(0.5) and got["top_k"] == 40 and "top_p" not in got


def test_embedded_model_gets_its_model_card_values_and_presets_none():
    assert sampling_defaults("default") == EMBEDDED_DEFAULTS
    assert (EMBEDDED_DEFAULTS["temperature"], EMBEDDED_DEFAULTS["top_p"]) == (0.2, 0.9)
    assert sampling_defaults(str(default_model_path())) == EMBEDDED_DEFAULTS, "the same file by its path"
    assert sampling_defaults("preset:tiny") == {}
