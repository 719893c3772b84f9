"""The evaluation grid's fixed parts: the ablations (LOCKS basis bits x rank, the GQA group rules)
and the room kept for the answer; shared by the command's parser and the run."""

from __future__ import annotations

ABLATION_BITS = (16, 8, 4, 2)
ABLATION_RANKS = (2, 4, 8, 16)
ABLATION_RULES = ("group_max", "group_mass")
ANSWER_ROOM = 64  # tokens kept free for the answer when --contexts says "max"


def ablation_specs() -> list[str]:
    grid = [f"locks,basis_bits={b},rank={r}" for b in ABLATION_BITS for r in ABLATION_RANKS
            if (b, r) != (4, 8)]  # int4, rank 8 is "locks" itself
    return grid + [f"locks,group_rule={rule}" for rule in ABLATION_RULES]
