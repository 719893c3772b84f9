"""The decode targets table reads the benchmark's result files and judges each target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lockserve.cluster.measure.decode.targets import RUNS, main, rerun_commands, table

ROOT = Path(__file__).resolve().parents[4]
MODULE = "lockserve.cluster.measure.decode.bench"
OLD_MODULE = "lockserve.workers.bench"
# Committed files whose run RUNS has changed since, not yet re-run on a GPU: decode_glm4_1m.json ran
# --modes locks:host --reference locks:host (host compared with itself); RUNS now runs locks:hbm too.
RERUN_PENDING = {"decode_glm4_1m.json"}


def mode(tpot, roofline=None, tokens_per_s=None, pcie=0.0, hit=None, same=True):
    ratio = roofline and tpot / roofline
    return {"tpot_ms_median": tpot, "roofline_ms": roofline, "tpot_over_roofline": ratio,
            "tokens_per_s": tokens_per_s, "bytes_per_step": {"pcie": pcie}, "hit_rate": hit,
            "same_tokens_as_reference": same}


def write(folder: Path, name: str, modes: dict) -> None:
    (folder / name).write_text(json.dumps({"ceilings": {"gather_gbps": 50.0}, "modes": modes}))


def test_targets_are_met_or_missed_by_the_numbers(tmp_path):
    write(tmp_path, "decode_llama8b_128k.json", {"dense:hbm": mode(9.0, 8.0), "locks:hbm": mode(7.6),
                                                 "locks:host": mode(12.0, pcie=250e6, hit=0.1)})
    write(tmp_path, "decode_llama8b_512k.json", {"dense:hbm": mode(30.0, 20.0), "locks:hbm": mode(9.0)})
    write(tmp_path, "decode_smollm2_128k.json", {"locks:hbm": mode(2.0), "locks:host": mode(2.1, hit=0.98)})
    lines = table(tmp_path).splitlines()[2:]
    verdict = {line.split(" | ")[0].lstrip("| "): line.rstrip(" |").split(" | ")[-1] for line in lines}
    assert verdict["Llama-3.1-8B 128K: dense:hbm <= 1.25 x roofline"] == "met"  # 9 / 8 = 1.125
    assert verdict["Llama-3.1-8B 128K: locks:hbm <= 7.5 ms"] == "**missed**"
    assert verdict["Llama-3.1-8B 512K: dense:hbm <= 1.25 x roofline"] == "**missed**"  # 1.5
    assert verdict["Llama-3.1-8B 512K: locks:hbm <= 0.45 x dense:hbm"] == "met"  # 0.3
    # 12.0 <= 7.6 + 1.2 * (250e6 B / 50 GB/s = 5 ms) = 13.6
    assert verdict["Llama-3.1-8B 128K: locks:host <= locks:hbm + 1.2 x PCIe / gather"] == "met"
    assert verdict["SmolLM2-135M 128K: locks:host <= 1.1 x locks:hbm, same tokens"] == "met"
    assert not any("GLM" in key for key in verdict), "no GLM file, no GLM row"


def test_the_committed_results_make_a_table():
    rows = table(ROOT / "docs" / "results").splitlines()[2:]
    assert len(rows) >= 10 and all(row.endswith(("met |", "**missed** |")) for row in rows)


def test_a_repeated_run_shows_each_runs_ratio(tmp_path):
    host, hbm = mode(2.2, hit=0.98), mode(2.0)
    host["repeat_tpot_ms"], hbm["repeat_tpot_ms"] = [2.2, 2.4], [2.0, 2.0]
    write(tmp_path, "decode_smollm2_128k.json", {"locks:hbm": hbm, "locks:host": host})
    [row] = [r for r in table(tmp_path).splitlines() if "locks:host <= 1.1" in r]
    assert "runs 1.100, 1.200 x" in row and row.endswith("met |")  # the pooled figures decide


def test_rerun_repeats_the_committed_files_commands():
    """--rerun runs what made each committed target file (its JSON's command, device paths as the
    files write them), so a user's rerun is comparable line by line."""
    results = ROOT / "docs" / "results"
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    for (name, _), cmd in zip(RUNS, rerun_commands(results, gguf, []), strict=True):
        committed = json.loads((results / name).read_text())["command"]
        # NOTE: files written before the bench moved name its old module; the flags are what matter.
        committed = [MODULE if c == OLD_MODULE else c for c in committed]
        rel = [str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c for c in cmd[1:]]
        if name in RERUN_PENDING:
            assert rel != committed[1:], f"{name} was re-run with RUNS' command: drop it from RERUN_PENDING"
            continue
        assert rel == committed[1:], name
    extra = rerun_commands(Path("out"), gguf, ["--radix-bits", "2"])[0]
    assert extra[-4:] == ["--radix-bits", "2", "--out", str(Path("out") / RUNS[0][0])]


def test_rerun_needs_the_model_file_and_dry_run_prints(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--rerun"])
    assert "--rerun needs --gguf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--dry-run"])
    assert main([str(tmp_path), "--rerun", "--gguf", "m.gguf", "--dry-run", "--", "--radix-bits", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(RUNS) and all("--radix-bits 2 --out" in line for line in printed)
    assert not list(tmp_path.iterdir()), "a dry run writes nothing"
    only = [RUNS[1][0], RUNS[3][0]]
    assert main([str(tmp_path), "--rerun", "--gguf", "m.gguf", "--dry-run", "--only", *only]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert [line.split("--out ")[-1] for line in printed] == [str(tmp_path / name) for name in only]
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--only", RUNS[0][0]])


def test_a_failed_rerun_says_which_run_and_stops(capfd, tmp_path, monkeypatch):
    from lockserve.cluster.measure.decode import targets as decode_targets

    # two real bench runs: the bench refuses the first (--context must be >= 2)
    monkeypatch.setattr(decode_targets, "RUNS", [("decode_bad.json", "--model tiny --context 1"),
                                                 ("decode_next.json", "--model tiny --context 64")])
    assert main([str(tmp_path), "--rerun", "--gguf", "unused.gguf"]) == 2
    err = capfd.readouterr().err  # the bench's own message, then ours
    assert "--context >= 2" in err and "the run for decode_bad.json failed (exit 2)" in err
    assert not (tmp_path / "decode_next.json").exists(), "it stops at the failed run"


def test_a_missed_ratio_says_where_the_time_goes(tmp_path):
    """A missed SmolLM2 host ratio names the graph spans, the time outside them and the parts
    whose device time grew (from the modes' profiles); a met one says none of it."""
    host, hbm = mode(2.2, hit=0.98), mode(1.9)
    host["profile"] = {"graph_span_ms": 1.94, "device_time_us_by_part": {"transfer": 196.0, "weights": 483.0}}
    hbm["profile"] = {"graph_span_ms": 1.74, "device_time_us_by_part": {"transfer": 2.0, "weights": 478.0}}
    write(tmp_path, "decode_smollm2_128k.json", {"locks:hbm": hbm, "locks:host": host})
    [row] = [r for r in table(tmp_path).splitlines() if "locks:host <= 1.1" in r]
    assert "where: graph span 1.94 vs 1.74 ms, outside it 0.26 vs 0.16 ms" in row
    assert "device time transfer +194 us" in row and "weights" not in row  # +5 us is not named
    assert row.endswith("**missed** |")
    host["tpot_ms_median"] = 2.05
    write(tmp_path, "decode_smollm2_128k.json", {"locks:hbm": hbm, "locks:host": host})
    [row] = [r for r in table(tmp_path).splitlines() if "locks:host <= 1.1" in r]
    assert "where:" not in row and row.endswith("met |")
