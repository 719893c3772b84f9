"""Hugging Face tensor names <-> CausalLM parameters.

Our parameters carry Hugging Face's names without the ``model.`` prefix, except two fused
projections: ``self_attn.qkv_proj`` holds the rows of q_proj, k_proj, v_proj (in that order) and
``mlp.gate_up_proj`` those of gate_proj, up_proj. Checkpoints that store them fused too (Phi-3's
both, GLM's gate_up_proj: ``Architecture.fused_in_checkpoint``) give the whole tensor under our
name. Loaders speak Hugging Face names only.

Where the checkpoint's rotary layout is not ours (partial or interleaved rotary), the dimensions of
every q and k head (rows of q and k, their biases, Qwen3's q/k norm weights) are permuted into our
layout here (rope.head_dim_order) and back in ``hf_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from lockserve.workers.model.rope import head_dim_order
from torch import Tensor

if TYPE_CHECKING:
    from lockserve.workers.model.model import CausalLM, ModelConfig

# HF sub-name of a fused projection -> (our parameter, which block of its rows).
FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def fused_row_sizes(name: str, config: ModelConfig) -> list[int]:
    """Row counts of the blocks of a fused parameter: [q, k, v] or [gate, up]."""
    if "gate_up_proj" in name:
        return [config.intermediate_size] * 2
    kv_rows = config.num_kv_heads * config.head_dim
    return [config.num_heads * config.head_dim, kv_rows, kv_rows]


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


def _fused_suffix(name: str) -> str | None:
    """"qkv_proj" or "gate_up_proj" for one of our fused parameters, else None."""
    for suffix in ("qkv_proj", "gate_up_proj"):
        if f".{suffix}." in f".{name}":
            return suffix
    return None


class HeadLayout:
    """Permutes the dimensions of q and k heads between a checkpoint's rotary layout and ours."""

    def __init__(self, config: ModelConfig):
        order = head_dim_order(config.head_dim, config.rotary_dim, config.arch.rope_interleaved)
        self.head_dim = config.head_dim
        self.order = None if order is None else torch.tensor(order)
        self.inverse = None if order is None else torch.argsort(self.order)

    @staticmethod
    def applies(name: str, block: int | None) -> bool:
        """Whether a piece holds q or k head dimensions: qkv_proj blocks 0 and 1, q/k norm weights."""
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            return block in (0, 1)
        return name.endswith(("q_norm.weight", "k_norm.weight"))

    def to_ours(self, name: str, block: int | None, tensor: Tensor) -> Tensor:
        # tensor: [H d, ...] rows (or [d]) in the checkpoint's layout -> the same in ours
        return self._permute(tensor, self.order) if self.applies(name, block) else tensor

    def to_checkpoint(self, name: str, block: int | None, tensor: Tensor) -> Tensor:
        return self._permute(tensor, self.inverse) if self.applies(name, block) else tensor

    def _permute(self, tensor: Tensor, order: Tensor | None) -> Tensor:
        if order is None:
            return tensor
        heads = tensor.unflatten(0, (-1, self.head_dim))  # [H, d, ...]
        return heads[:, order.to(tensor.device)].flatten(0, 1)


def hf_state_dict(model: CausalLM) -> dict[str, Tensor]:
    """{Hugging Face name: tensor} for every weight. Fused blocks are views into our parameters;
    q/k pieces of a permuted layout (HeadLayout) are copies."""
    config, layout = model.config, HeadLayout(model.config)
    out: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        suffix = _fused_suffix(name)
        if suffix is None:
            out[_hf_name(name)] = layout.to_checkpoint(name, None, param.data)
            continue
        blocks = [layout.to_checkpoint(name, b, t)
                  for b, t in enumerate(param.data.split(fused_row_sizes(name, config), dim=0))]
        if suffix in config.arch.fused_in_checkpoint:
            out[_hf_name(name)] = torch.cat(blocks) if layout.order is not None else param.data
            continue
        for hf_part, (ours, block) in FUSED.items():
            if ours.endswith(suffix):
                out[_hf_name(name.replace(ours, hf_part))] = blocks[block]
    return out


class WeightFiller:
    """Copies Hugging Face-named tensors into a CausalLM and remembers which pieces it filled."""

    def __init__(self, model: CausalLM, source: str):
        self.model, self.source = model, source
        self.params = dict(model.named_parameters())
        self.expected = {_piece_key(name, block) for name, block in self._pieces()}
        self.filled: set[str] = set()
        self.layout = HeadLayout(model.config)

    def _pieces(self) -> Iterator[tuple[str, int | None]]:
        """(parameter name, block) for every piece a checkpoint must provide."""
        for name in self.params:
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight")):
                blocks = len(fused_row_sizes(name, self.model.config))
                yield from ((name, block) for block in range(blocks))
            else:
                yield name, None

    def fill(self, hf_name: str, tensor: Tensor) -> None:
        """Copy one tensor in (cast to the model's dtype and device)."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return  # recomputed from the config
        if hf_name == "lm_head.weight" and self.model.lm_head is None:
            return  # tied: the embedding is the head (some checkpoints store both)
        name, block = _our_name(hf_name)
        if name not in self.params:
            config = self.model.config
            raise ValueError(
                f"{self.source}: unexpected weight {hf_name!r} for {config.architecture} "
                f"with {config.num_layers} layers"
            )
        if block is None and _fused_suffix(name) is not None:  # stored fused, as we hold it
            self._check_shape(hf_name, tensor, self.params[name].data)
            for block, piece in enumerate(tensor.split(fused_row_sizes(name, self.model.config), dim=0)):
                self._fill_piece(hf_name, name, block, piece)
        else:
            self._fill_piece(hf_name, name, block, tensor)

    def _fill_piece(self, hf_name: str, name: str, block: int | None, tensor: Tensor) -> None:
        key = _piece_key(name, block)
        if key in self.filled:
            raise ValueError(f"{self.source}: weight {hf_name!r} given twice")
        target = self._target(name, block)
        self._check_shape(hf_name, tensor, target)
        tensor = self.layout.to_ours(name, block, tensor)
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self.filled.add(key)

    def _check_shape(self, hf_name: str, tensor: Tensor, target: Tensor) -> None:
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{self.source}: weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"the config needs {tuple(target.shape)}"
            )

    def _target(self, name: str, block: int | None) -> Tensor:
        param = self.params[name].data
        if block is None:
            return param
        return param.split(fused_row_sizes(name, self.model.config), dim=0)[block]

    def check_complete(self) -> None:
        """ValueError naming the first few parameters no tensor was given for."""
        missing = sorted(self.expected - self.filled)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ValueError(f"{self.source}: missing weights for {', '.join(missing[:5])}{more}")


def _our_name(hf_name: str) -> tuple[str, int | None]:
    name = hf_name.removeprefix("model.")
    for hf_part, (ours, block) in FUSED.items():
        if f".{hf_part}." in f".{name}":
            return name.replace(hf_part, ours), block
    return name, None


def _piece_key(name: str, block: int | None) -> str:
    return name if block is None else f"{name}[{block}]"
