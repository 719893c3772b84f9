"""Tiny random models built by transformers from its own config classes, saved as Hugging Face
folders, and both sides of the comparison: transformers' greedy tokens and logits, ours through
``LLM(folder)`` and ``load_model(folder)``.

Weights are redrawn at unit scale (transformers initialises at std 0.02, whose near-uniform logits
would let two different models agree on greedy tokens by accident); norm weights and biases
are drawn away from 1 and 0, so a norm or bias applied wrongly changes the tokens.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import transformers
from lockserve.workers.api import LLM
from lockserve.workers.engine.sampling import SamplingParams
from lockserve.workers.model.dense_attention import DenseAttention
from lockserve.workers.model.loader import load_model
from lockserve.workers.model.tokenizer import byte_level_tokenizer

# Shared by every tiny config: GQA (G = 2), head_dim 32, vocabulary over the byte-level tokenizer.
TINY = dict(
    vocab_size=288,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=0,
    tie_word_embeddings=False,
)
_G = torch.Generator().manual_seed(1234)
PROMPT = torch.randint(0, 256, (320,), generator=_G).tolist()  # a few hundred byte tokens
NEW_TOKENS = 20


def build_hf(config: transformers.PretrainedConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """A float32 eager-attention transformers model of ``config`` with unit-scale random weights."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g)
            if param.dim() == 1 and "norm" in name:
                param.copy_(1 + 0.3 * noise)
            elif param.dim() == 1:  # biases
                param.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:  # [out, in]; the head a little hotter so greedy choices are clear
                scale = 3.0 if "lm_head" in name else 1.0
                param.copy_(noise * scale / math.sqrt(param.shape[1]))
    return model


def save_folder(model: transformers.PreTrainedModel, folder: Path) -> Path:
    """``model`` as a Hugging Face folder (safetensors) with the byte-level tokenizer."""
    model.save_pretrained(folder, safe_serialization=True)
    byte_level_tokenizer().save_hf_folder(folder)
    assert list(folder.glob("*.safetensors")), "save_pretrained wrote no safetensors"
    return folder


def hf_greedy(model: transformers.PreTrainedModel, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of transformers' generate: n of them, EOS a token like any other (as
    SamplingParams(ignore_eos=True) has it; min_new_tokens would instead forbid EOS)."""
    # NOTE: an explicit all-ones mask: without one, generate masks every prompt token equal to
    # pad_token_id.
    input_ids = torch.tensor([ids])
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=n, do_sample=False, eos_token_id=[], pad_token_id=TINY["pad_token_id"])
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    assert out.shape[1] == len(ids) + n, f"generate stopped after {out.shape[1] - len(ids)} of {n} tokens"
    return out[0, len(ids) :].tolist()


def saved_case(name: str, config: transformers.PretrainedConfig, folder: Path, seed: int,
               prompt: list[int]) -> tuple[str, transformers.PreTrainedModel, Path, list[int]]:
    """A test case's (name, transformers model, its saved folder, transformers' greedy tokens after
    prompt): the model built from config with seeded weights, saved with save_pretrained."""
    hf = build_hf(config, seed=seed)
    saved = save_folder(hf, folder)
    expected = hf_greedy(hf, prompt)
    assert len(set(expected)) > 4, f"{name}: transformers' tokens {expected} are too uniform"
    return name, hf, saved, expected


def hf_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[T, vocab] float32, the whole prompt in one forward."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def our_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    """[T, vocab] float32 of the folder loaded by load_model, the whole prompt in one forward."""
    return model_logits(load_model(folder)[0], ids)


def model_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, vocab] float32 of a loaded CausalLM, the whole prompt in one forward (DenseAttention)."""
    attn = DenseAttention(model.config.num_layers)
    attn.begin_step(["s"], [len(ids)])
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), attn))


def our_greedy(folder: Path, ids: list[int], n: int = NEW_TOKENS, **llm) -> list[int]:
    """Greedy tokens of ``LLM(folder, **llm)``, on the CPU unless ``device`` says otherwise
    (keyword arguments: attention, tier, device, dtype, ...)."""
    llm = {"attention": "dense", "tier": "hbm", "budget_tokens": 1024, "kv_capacity_tokens": 2048,
           "host_capacity_gib": 0.05, "device": "cpu", **llm}
    with LLM(str(folder), **llm) as engine:
        [completion] = engine.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return completion.token_ids


# (attention, tier) runs that must each give transformers' tokens: a LOCKS budget above the
# context (prompt + new tokens < 1024) selects every page, so it equals dense.
MODES = [("dense", "hbm"), ("locks", "hbm"), ("locks", "host"), ("dense", "host")]
