"""Hugging Face tensor names <-> CausalLM parameters.

Our parameters carry Hugging Face's names without the ``model.`` prefix, except two fused
projections: ``self_attn.qkv_proj`` holds the rows of q_proj, k_proj, v_proj (in that order) and
``mlp.gate_up_proj`` those of gate_proj, up_proj. Loaders speak Hugging Face names only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

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


def hf_state_dict(model: CausalLM) -> dict[str, Tensor]:
    """{Hugging Face name: tensor} for every weight; fused blocks are views into our parameters."""
    out: dict[str, Tensor] = {}
    for name, param in model.named_parameters():
        fused = [(hf_part, block) for hf_part, (ours, block) in FUSED.items() if f".{ours}." in f".{name}"]
        if not fused:
            out[_hf_name(name)] = param.data
            continue
        blocks = param.data.split(fused_row_sizes(name, model.config), dim=0)
        for hf_part, block in fused:
            out[_hf_name(name.replace(FUSED[hf_part][0], hf_part))] = blocks[block]
    return out


class WeightFiller:
    """Copies Hugging Face-named tensors into a CausalLM and remembers which pieces it filled."""

    def __init__(self, model: CausalLM, source: str):
        self.model, self.source = model, source
        self.params = dict(model.named_parameters())
        self.expected = {_piece_key(name, block) for name, block in self._pieces()}
        self.filled: set[str] = set()

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
        key = _piece_key(name, block)
        if key in self.filled:
            raise ValueError(f"{self.source}: weight {hf_name!r} given twice")
        target = self._target(name, block)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"{self.source}: weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"the config needs {tuple(target.shape)}"
            )
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        self.filled.add(key)

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
