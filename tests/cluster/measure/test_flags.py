"""The measurement commands' shared flags: declared once (harness/flags.py), help that states the
default the code uses, and --device resolved at the parse."""

import argparse

import pytest
import torch
from lockserve.cluster.cli import build_parser
from lockserve.cluster.measure.decode import bench
from lockserve.cluster.measure.harness import flags

SHARED = ("--model", "--modes", "--device", "--nvme-dir", "--prefill-chunk", "--graphs", "--fill",
          "--steps", "--warmup", "--budget-tokens", "--name")


def _subparsers(parser: argparse.ArgumentParser):
    """Every (path, parser) under parser, itself included."""
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _subparsers(sub)


def _measurement_parsers():
    for prog, p in _subparsers(build_parser()):
        if any(word in prog.split() for word in ("bench", "experiment", "eval")):
            yield prog, p


def test_the_measurement_commands_are_found():
    progs = {prog.split(maxsplit=1)[1] for prog, _ in _measurement_parsers()}
    assert {"bench decode", "bench prefill", "experiment capacity", "eval retrieval"} <= progs


@pytest.mark.parametrize("prog,parser", list(_measurement_parsers()))
def test_shared_flags_state_the_default_the_code_uses(prog, parser):
    for action in parser._actions:
        flag = next((o for o in action.option_strings if o in SHARED), None)
        if flag is None or action.default is None:
            continue
        default = action.default
        shown = " ".join(default) if isinstance(default, list) else str(default)
        assert f"default {shown})" in action.help or f"default: {shown})" in action.help, (prog, flag)


def test_each_command_says_why_its_prefill_chunk():
    chunks = {}
    for prog, p in _measurement_parsers():
        action = next((a for a in p._actions if "--prefill-chunk" in a.option_strings), None)
        if action is not None:
            chunks[prog.split(maxsplit=1)[1]] = action.default
            assert action.help.startswith("prompt tokens per prefill step ("), prog
    assert chunks == {"bench decode": 4096, "bench prefill": 8192, "experiment capacity": 512,
                      "eval retrieval": 2048}


def test_device_auto_is_resolved_at_the_parse():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert flags.device_name("auto") == expected
    assert flags.device_name("cuda:1") == "cuda:1"
    args = build_parser().parse_args(["bench", "prefill", "--out", "x"])
    assert args.device == expected
    args = bench.parse_args(["--out", "x.json", "--modes", "locks:hbm"])
    assert args.device == expected
    assert build_parser().parse_args(["bench", "prefill", "--out", "x", "--device", "cpu"]).device == "cpu"
