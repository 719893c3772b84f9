"""The decoder against Hugging Face transformers' own Llama / Qwen2 on tiny configs (CPU, float32),
and its pieces (RoPE scaling, config parsing, presets) against references."""

from __future__ import annotations

import math

import pytest
import torch
import transformers  # the reference implementation (test extra; GGUF loading also needs accelerate)
from lockserve.workers.model.dense_attention import DenseAttention, generate_greedy
from lockserve.workers.model.loader import load_model, save_hf_folder
from lockserve.workers.model.model import CausalLM, ModelConfig
from lockserve.workers.model.presets import PRESETS, build_preset, preset_config
from lockserve.workers.model.rope import rope_inv_freq

from tests.conftest import assert_close

PROMPT = "The quick brown fox, ünïcödé 😀 and <|im_start|>tokens"


def _hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _prefill_logits(model: CausalLM, ids: list[int]) -> torch.Tensor:
    attn = DenseAttention(model.config.num_layers)
    attn.begin_step(["s"], [len(ids)])
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)  # [T, hidden]
    return model.compute_logits(hidden)  # [T, vocab]


@pytest.fixture(scope="module", params=["tiny", "tiny-qwen2", "tiny-llama3"])
def saved_preset(request, tmp_path_factory):
    """(preset name, HF folder, our model loaded back from it, our tokenizer)."""
    name = request.param
    model, tokenizer = build_preset(name, seed=7)
    folder = tmp_path_factory.mktemp(name)
    # The plain tiny preset is written in shards, so the index path of the loader is exercised too.
    save_hf_folder(model, tokenizer, folder, max_shard_bytes=60_000 if name == "tiny" else None)
    loaded, loaded_tokenizer = load_model(folder)
    return name, folder, loaded, loaded_tokenizer


def test_prefill_logits_equal_transformers(saved_preset):
    name, folder, model, tokenizer = saved_preset
    hf = _hf_model(folder)
    assert type(hf).__name__ == PRESETS[name].architecture
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]  # [T, vocab]
    actual = _prefill_logits(model, ids)
    assert actual.dtype == torch.float32 and actual.shape == (len(ids), model.config.vocab_size)
    assert_close(actual, expected, f"{name}: prefill logits vs transformers")


def test_greedy_tokens_equal_transformers(saved_preset):
    name, folder, model, tokenizer = saved_preset
    hf = _hf_model(folder)
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([ids]), max_new_tokens=20, do_sample=False, min_new_tokens=20, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert generate_greedy(model, ids, 20) == expected, name


def test_llama3_rope_scaling_matches_transformers_and_matters():
    config = preset_config("tiny-llama3")
    hf_config = transformers.LlamaConfig(
        **{k: v for k, v in config.to_hf_config().items() if k not in ("architectures", "model_type")}
    )
    rope_init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    expected, _ = rope_init(hf_config, torch.device("cpu"))
    actual, attention_factor = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
    assert attention_factor == 1.0
    assert_close(actual, expected, "llama3 inverse frequencies")
    plain, _ = rope_inv_freq(config.head_dim, config.rope_theta, None)
    wavelen = 2 * math.pi / plain
    old = config.rope_scaling["original_max_position_embeddings"]
    # All three bands present: kept (short wavelengths), divided by factor (long), interpolated (between).
    assert torch.equal(actual[wavelen < old / 4], plain[wavelen < old / 4])
    assert_close(actual[wavelen > old], plain[wavelen > old] / 8.0, "long wavelengths / factor")
    middle = (wavelen >= old / 4) & (wavelen <= old)
    assert (
        middle.any() and (actual[middle] < plain[middle]).all() and (actual[middle] > plain[middle] / 8).all()
    )


def test_qkv_bias_is_used():
    """Zeroing the q/k/v biases of the Qwen2 preset changes the logits (the bias path is live);
    the transformers comparison above checks it is applied the right way."""
    model, tokenizer = build_preset("tiny-qwen2", seed=3)
    ids = tokenizer.encode("bias check")
    before = _prefill_logits(model, ids)
    for layer in model.layers:
        layer.self_attn.qkv_proj.bias.zero_()
    assert (before - _prefill_logits(model, ids)).abs().max() > 1e-2


def test_random_presets_stay_finite_over_many_layers():
    config = preset_config("tiny").replace(num_layers=48)
    model = CausalLM(config)
    from lockserve.workers.model.presets import init_random

    init_random(model, seed=0)
    logits = _prefill_logits(model, list(range(40)))
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std() < 100, f"logit std {logits.std():.3g} drifted over 48 layers"


def test_build_preset_is_seeded():
    a, _ = build_preset("tiny", seed=5)
    b, _ = build_preset("tiny", seed=5)
    c, _ = build_preset("tiny", seed=6)
    ids = list(range(10, 30))
    assert torch.equal(_prefill_logits(a, ids), _prefill_logits(b, ids))
    assert not torch.equal(_prefill_logits(a, ids), _prefill_logits(c, ids))


def test_big_presets_have_the_real_shapes():
    llama8b = preset_config("llama-3.1-8b")
    assert (llama8b.num_layers, llama8b.num_heads, llama8b.num_kv_heads, llama8b.head_dim) == (32, 32, 8, 128)
    assert llama8b.rope_scaling["rope_type"] == "llama3" and llama8b.rope_scaling["factor"] == 8.0
    qwen = preset_config("qwen2.5-7b")
    assert qwen.qkv_bias and (qwen.hidden_size, qwen.num_kv_heads, qwen.num_layers) == (3584, 4, 28)
    llama1b = preset_config("llama-3.2-1b")
    assert llama1b.tie_word_embeddings and llama1b.rope_scaling["factor"] == 32.0
    with pytest.raises(ValueError, match=r"preset \('llama-9b'\) is unknown"):
        preset_config("llama-9b")


def test_glm_and_qwen3_presets_copy_their_published_configs():
    """GLM-4-9B-Chat-1M: multi_query_group_num 4, rope_ratio 10000; GLM-4-9B-Chat: 2 and 500."""
    glm1m, glm, qwen3 = (preset_config(n) for n in ("glm-4-9b-chat-1m", "glm-4-9b-chat", "qwen3-8b"))
    assert (glm1m.num_kv_heads, glm1m.rope_theta, glm1m.max_position_embeddings) == (4, 1e8, 1 << 20)
    assert (glm.num_kv_heads, glm.rope_theta, glm.max_position_embeddings) == (2, 5e6, 1 << 17)
    assert glm1m.qkv_bias and (glm1m.num_layers, glm1m.intermediate_size) == (40, 13696)
    assert (qwen3.num_layers, qwen3.num_kv_heads, qwen3.intermediate_size) == (36, 8, 12288)
    assert not qwen3.qkv_bias and qwen3.vocab_size == 151936
    assert glm1m.architecture == "GlmForCausalLM" and glm1m.partial_rotary_factor == 0.5
    assert qwen3.architecture == "Qwen3ForCausalLM" and qwen3.arch.qk_norm
    gemma = preset_config("gemma-3-12b")
    assert (gemma.num_layers, gemma.num_kv_heads, gemma.head_dim, gemma.sliding_window) == (48, 8, 256, 1024)
    local = gemma.sliding_layers or ()
    assert 5 not in local and len(local) == 40 and gemma.local_rope_theta == 1e4
    with pytest.raises(ValueError, match=r"glm-4-9b-1m-shape.*removed.*glm-4-9b-chat-1m"):
        preset_config("glm-4-9b-1m-shape")


def test_from_hf_config_reads_both_rope_spellings():
    old = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": [5, 6],
        "bos_token_id": 4,
    }
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_theta": 500000.0, **old["rope_scaling"]}
    for hf in (old, new):
        config = ModelConfig.from_hf_config(hf)
        assert config.rope_theta == 500000.0 and config.rope_scaling["factor"] == 8.0
        assert config.head_dim == 16 and config.eos_token_ids == (5, 6) and not config.qkv_bias
    qwen = ModelConfig.from_hf_config(
        {
            **new,
            "architectures": ["Qwen2ForCausalLM"],
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
        }
    )
    assert qwen.qkv_bias and qwen.rope_scaling is None and qwen.rope_theta == 1e6


def test_config_errors_name_the_field_and_value():
    with pytest.raises(ValueError, match=r"architectures \(\['GPT2LMHeadModel'\]\) is not supported"):
        ModelConfig.from_hf_config({"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"):
        preset_config("tiny").replace(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match=r"hidden_size \(0\) must be a positive int"):
        preset_config("tiny").replace(hidden_size=0)
    with pytest.raises(ValueError, match=r"rope_type \('ntk-by-parts'\) is not supported; supported: \['def"):
        rope_inv_freq(16, 10000.0, {"rope_type": "ntk-by-parts", "factor": 4.0})


def test_compute_logits_is_float32_in_bfloat16():
    model, tokenizer = build_preset("tiny", seed=0, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rotary.inv_freq.dtype == torch.float32
    logits = _prefill_logits(model, tokenizer.encode("bf16"))
    reference, _ = build_preset("tiny", seed=0, dtype=torch.float32)
    assert logits.dtype == torch.float32
    # bf16 weights are the float32 ones rounded, so the logits agree loosely.
    assert (logits - _prefill_logits(reference, tokenizer.encode("bf16"))).abs().max() < 0.25


@pytest.mark.gpu
def test_forward_captures_in_a_cuda_graph():
    """No host synchronisation inside forward: a CUDA graph of a decode step replays to the eager result."""
    device = torch.device("cuda")
    model, _ = build_preset("tiny", seed=0, device=device, dtype=torch.bfloat16)

    def causal_attn(layer, x):  # the new tokens only
        q, k, v = x.split_rotated()  # [T, Hq, d], [T, Hkv, d] x 2
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True)
        return o.transpose(0, 1)

    ids = torch.randint(0, 256, (24,), device=device)
    positions = torch.arange(24, device=device)
    eager = model.compute_logits(model(ids, positions, causal_attn))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(ids, positions, causal_attn)  # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model.compute_logits(model(ids, positions, causal_attn))
    graph.replay()
    assert_close(captured, eager, "CUDA graph replay vs eager", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name",
    ["llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b", "glm-4-9b-chat-1m", "glm-4-9b-chat", "qwen3-8b",
     "gemma-3-12b"],
)
def test_real_shape_presets_run_finite_on_gpu(name):
    """The random-weight benchmark presets at full size, bf16: finite, unit-scale logits after every layer."""
    device = torch.device("cuda")
    model, tokenizer = build_preset(name, seed=0, device=device, dtype=torch.bfloat16)
    ids = tokenizer.encode("a benchmark prompt " * 8)
    attn = DenseAttention(model.config.num_layers)
    attn.begin_step([0], [len(ids)])
    with torch.no_grad():
        logits = model.compute_logits(
            model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), attn)
        )
    assert logits.shape == (len(ids), model.config.vocab_size) and torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 100, f"{name}: logit std {logits.std().item():.3g}"
    del model, attn
    torch.cuda.empty_cache()
