"""`lockserve bench prefill` on the CPU (tiny preset): the files and fields its readers need, warm
requests that reuse the document and give the cold request's tokens, and the beside run under the
scheduler's caps (the prefill's steps beside the decoder follow scheduler.prefill_chunk_decoding
and prefill_attention_decoding exactly), and a cold prefill stopped at --time-limit."""

from __future__ import annotations

import argparse
import json

import pytest
from lockserve.cluster.cli import main
from lockserve.cluster.measure.commands import add_prefill_arguments, prefill_arguments
from lockserve.cluster.measure.prefill import extrapolate, extrapolated_status, split_by_end, window_tokens
from lockserve.configs.schema import SchedulerConfig
from lockserve.workers.engine.scheduler import tokens_within

CONTEXT, QUESTION, CHUNK, BESIDE_CHUNK, BESIDE_WORK = 512, 8, 128, 32, 4096


def expected_beside_steps() -> int:
    """Steps of a CONTEXT-token prompt prefilled beside a decoding request under both caps."""
    start, steps = 0, 0
    while start < CONTEXT:
        start += min(CHUNK, CONTEXT - start, BESIDE_CHUNK, max(1, tokens_within(BESIDE_WORK, start)))
        steps += 1
    return steps


def test_bench_prefill_on_cpu(tmp_path):
    argv = ["bench", "prefill", "--model", "tiny", "--device", "cpu", "--contexts", str(CONTEXT),
            "--prefill-chunk", str(CHUNK), "--question", str(QUESTION), "--modes", "locks:hbm", "locks:host",
            "--beside", "--beside-context", "64", "--beside-steps", "8", "--beside-chunk", str(BESIDE_CHUNK),
            "--beside-attention", "4K", "--beside-layers", "2", "--out", str(tmp_path), "--name", "p"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["command"] == ["lockserve", *argv] and result["commit"] and result["device"] == "cpu"
    # (--beside-layers reaches the engine; on the CPU, without graphs, it runs each forward whole)
    assert (result["beside_chunk"], result["beside_attention"], result["beside_layers"]) == \
        (BESIDE_CHUNK, BESIDE_WORK, 2)
    assert str(CONTEXT) in result["plain"] and result["plain"][str(CONTEXT)]["seconds"] > 0
    assert [r["mode"] for r in result["rows"]] == ["locks:hbm", "locks:host"]
    hbm, host = result["rows"]
    assert hbm["x_hbm"] is None, "locks:hbm is not compared with itself"
    assert hbm["host_share"] is None, "steps are timed one by one only under --time-limit"
    assert host["x_hbm"] == pytest.approx(host["prefill_s"] / hbm["prefill_s"]), host
    table = (tmp_path / "p.md").read_text()
    assert "x locks:hbm" in table and "prompt beside (s)" in table
    for row, point in zip(result["rows"], result["points"], strict=True):
        assert row["status"] == "ok", row
        assert row["warm_same_tokens"] is True and row["cached_tokens"] == CONTEXT, row
        assert row["prefill_s"] > 0 and row["x_plain"] > 0
        beside = point["result"]["beside"]
        assert beside["prefill_beside_steps"] == expected_beside_steps() == 37, beside
        assert beside["tpot_alone_ms"]["n"] == 8 and beside["tpot_beside_ms"]["n"] >= 36
        # on the CPU each chunk's forward runs whole: every step beside it ends one
        split = beside["tpot_beside_split_ms"]
        assert split["ended"]["steps_ms"] == beside["tpot_beside_ms"]["steps_ms"], split
        assert split["part"] == {"p50": None, "p99": None, "n": 0, "steps_ms": []}, split
        # the table's beside columns: the p99 ratio, the prompt's time and steps beside the decoder
        assert row["tpot_x_alone"] == pytest.approx(row["tpot_beside_p99_ms"] / row["tpot_alone_p99_ms"])
        assert (row["prefill_beside_s"], row["beside_steps"]) == (beside["prefill_beside_s"], 37), row
    for suffix in ("csv", "md"):
        assert (tmp_path / f"p.{suffix}").stat().st_size > 0


def test_the_beside_run_measures_the_servers_scheduler_unless_told_and_none_turns_a_cap_off():
    served = SchedulerConfig()
    args = prefill_arguments()
    assert (args.beside_chunk, args.beside_attention, args.beside_layers) == (
        served.prefill_chunk_decoding, served.prefill_attention_decoding, served.prefill_layers_decoding)
    parser = argparse.ArgumentParser()
    add_prefill_arguments(parser)
    args = parser.parse_args(["--out", ".", "--beside-chunk", "none", "--beside-attention", "1M",
                              "--beside-layers", "None"])
    assert (args.beside_chunk, args.beside_attention, args.beside_layers) == (None, 1 << 20, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--out", ".", "--beside-layers", "four"])


def test_split_by_end_keeps_each_steps_kind():
    """A spread forward's steps (on the GPU): the part steps and the steps that ended a chunk's
    forward get their own percentiles, in step order."""
    split = split_by_end([5.0, 6.0, 14.0, 5.5, 15.0], [False, False, True, False, True])
    assert split["part"]["steps_ms"] == [5.0, 6.0, 5.5] and split["part"]["p99"] == 6.0, split
    assert split["ended"]["steps_ms"] == [14.0, 15.0] and split["ended"]["p50"] == 15.0, split


def test_without_beside_one_request_room_holds_the_warm_requests(tmp_path):
    """No --beside: the engine holds one request (batch 1), whose room holds the document and both
    questions; the warm request and the new question still reuse the document."""
    argv = ["bench", "prefill", "--model", "tiny", "--device", "cpu", "--contexts", str(CONTEXT),
            "--prefill-chunk", str(CHUNK), "--question", str(QUESTION), "--modes", "locks:host",
            "locks:host+nvme", "--nvme-dir", str(tmp_path / "nvme"), "--no-plain", "--out", str(tmp_path),
            "--name", "p"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "p.json").read_text())
    for row, point in zip(result["rows"], result["points"], strict=True):
        assert row["status"] == "ok" and row["warm_same_tokens"] is True, row
        assert row["cached_tokens"] == CONTEXT, row
        assert point["result"]["new_question"]["cached_tokens"] == CONTEXT, point["result"]["new_question"]
        room = CONTEXT + 2 * (QUESTION + 64) + 1 + 16  # the spec's room, bench_sizing's steps and slack
        assert point["result"]["stats"]["pages_capacity"] == -(-room // 16) + 1, "one request's pages"


def test_restart_reads_the_document_back_from_a_new_engines_nvme_dir(tmp_path):
    """--restart: the host+nvme engine's prefix saves are written, and a new engine over the same
    nvme_dir restores every full page of the document from NVMe (the restored-pages counter, not
    only the cached count) and gives the cold request's tokens; a host mode has no restart."""
    argv = ["bench", "prefill", "--model", "tiny", "--device", "cpu", "--contexts", str(CONTEXT),
            "--prefill-chunk", str(CHUNK), "--question", str(QUESTION), "--modes", "locks:host",
            "locks:host+nvme", "--nvme-dir", str(tmp_path / "nvme"), "--no-plain", "--no-warm", "--restart",
            "--out", str(tmp_path), "--name", "p"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "p.json").read_text())
    host, nvme = result["rows"]
    assert "restart_ttft_s" not in host and "restart" not in result["points"][0]["result"]
    assert nvme["status"] == "ok" and nvme["restart_cached"] == CONTEXT, nvme
    assert nvme["restart_same_tokens"] is True and nvme["restart_ttft_s"] > 0, nvme
    restart = result["points"][1]["result"]["restart"]
    assert restart["stats"]["prefix_disk_restored_pages"] == CONTEXT // 16, restart["stats"]
    assert "TTFT after restart (s)" in (tmp_path / "p.md").read_text()
    assert list((tmp_path / "nvme").iterdir()) == [], "the run's nvme directory is removed after it"


def test_host_nvme_inline_twice_and_nowait_give_the_same_tokens(tmp_path):
    """locks:host+nvme makes room behind the step, locks:host+nvme-inline in the allocation
    (cache.nvme_spill_behind off), locks:host+nvme-twice writes every spill, saved pages too
    (cache.nvme_saved_spills off), locks:host+nvme-nowait writes a spill rather than wait for
    queued saves (cache.nvme_wait_for_saves off; on by default); all spill half the document (the
    bench's arena) and give the same tokens. Each step's counters say where its time went
    (--time-limit times the steps)."""
    argv = ["bench", "prefill", "--model", "tiny", "--device", "cpu", "--contexts", str(CONTEXT),
            "--prefill-chunk", str(CHUNK), "--question", str(QUESTION), "--modes", "locks:host+nvme",
            "locks:host+nvme-inline", "locks:host+nvme-twice", "locks:host+nvme-nowait",
            "--nvme-dir", str(tmp_path / "nvme"), "--no-plain", "--no-warm", "--time-limit", "600",
            "--out", str(tmp_path), "--name", "p"]
    assert main(argv) == 0
    points = json.loads((tmp_path / "p.json").read_text())["points"]
    behind, inline, twice, nowait = (p["result"] for p in points)
    # behind the step: spills with a write, or (waiting for saves, the default) saved pages only
    assert nowait["stats"]["nvme_spilled_behind_pages"] > 0, nowait["stats"]
    assert behind["stats"]["nvme_spilled_behind_pages"] == 0, behind["stats"]
    assert inline["stats"]["nvme_spilled_behind_pages"] == 0 and inline["stats"]["nvme_spilled_pages"] > 0
    assert twice["stats"]["nvme_saved_spilled_pages"] == 0 and twice["stats"]["nvme_spilled_pages"] > 0
    assert nowait["stats"]["prefix_disk_room_waits"] == 0 and "prefix_disk_room_waits" in behind["stats"]
    tokens = [r["cold"]["tokens"] for r in (behind, inline, twice, nowait)]
    assert all(t == tokens[0] for t in tokens), tokens
    for r in (behind, inline, twice, nowait):
        cold = r["cold"]
        steps = -(-(CONTEXT + QUESTION) // CHUNK)
        assert len(cold["steps_host_s"]) == len(cold["steps_s"]) == len(cold["steps_stats"]) == steps
        assert all(0 < h <= s for h, s in zip(cold["steps_host_s"], cold["steps_s"], strict=True)), cold
        written = sum(step.get("bytes_written", 0) for step in cold["steps_stats"])
        assert 0 < written <= r["stats"]["bytes_written"], (written, r["stats"]["bytes_written"])
        assert sum(step.get("nvme_write_room_s", 0) for step in cold["steps_stats"]) > 0, cold["steps_stats"]
        assert r["stats"]["prefix_disk_writer_s"] > 0 and r["stats"]["prefix_disk_engine_s"] > 0, r["stats"]


def test_restart_without_a_host_nvme_mode_is_a_usage_error(tmp_path, capsys):
    argv = ["bench", "prefill", "--model", "tiny", "--device", "cpu", "--contexts", "64", "--modes",
            "locks:host", "--restart", "--out", str(tmp_path)]
    assert main(argv) != 0
    assert "--restart" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_extrapolate_recovers_a_prefill_whose_steps_follow_its_model():
    """Steps of c tokens at prefix s costing c (a + b (s + c / 2)), the first one slower (first
    calls): the fit skips it, finds a and b, and predicts the rest exactly; a partial last chunk
    included."""
    a, b, chunk, total = 2e-5, 3e-10, 1000, 9500
    sizes = [min(chunk, total - i * chunk) for i in range(10)]
    true = [c * (a + b * (i * chunk + c / 2)) for i, c in enumerate(sizes)]
    measured = [true[0] * 5, *true[1:4]]
    guess = extrapolate(measured, chunk, total)
    assert (guess["steps"], guess["measured_steps"]) == (10, 4)
    assert abs(guess["s_per_token"] - a) < 1e-12 and abs(guess["s_per_token_key"] - b) < 1e-16
    assert abs(guess["predicted_s"] - sum(true[4:])) < 1e-9
    assert abs(guess["ttft_s"] - (sum(measured) + sum(true[4:]))) < 1e-9
    assert guess["fit_max_error"] < 1e-9
    assert extrapolated_status(guess) == "extrapolated: 4 of 10 chunks measured (fit within 0.0%)"
    noisy = extrapolate([true[0], true[1], true[2] * 1.1, true[3]], chunk, total)
    assert 0.03 < noisy["fit_max_error"] < 0.1, noisy  # one of three fitted steps 10% off the line
    assert extrapolated_status(noisy).endswith(f"(fit within {noisy['fit_max_error']:.1%})")
    few = extrapolated_status(extrapolate(measured[:3], chunk, total))
    assert few == "extrapolated: 3 of 10 chunks measured (too few steps to check the fit)"
    for steps in ([], true):  # nothing measured, or every step: nothing to extrapolate
        with pytest.raises(ValueError, match="steps measured of 10"):
            extrapolate(steps, chunk, total)


def test_time_limit_stops_a_cold_prefill_and_says_it_extrapolated(tmp_path):
    argv = ["bench", "prefill", "--model", "tiny", "--device", "cpu", "--contexts", str(CONTEXT),
            "--prefill-chunk", "64", "--question", str(QUESTION), "--modes", "locks:hbm", "--no-plain",
            "--time-limit", "1e-6", "--out", str(tmp_path), "--name", "p"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "p.json").read_text())
    row, cold = result["rows"][0], result["points"][0]["result"]["cold"]
    steps = -(-(CONTEXT + QUESTION) // 64)
    assert result["time_limit_s"] == 1e-6
    assert row["status"] == f"extrapolated: 1 of {steps} chunks measured (too few steps to check the fit)"
    assert cold["tokens"] is None and len(cold["steps_s"]) == 1 and "warm_ttft_s" not in row
    assert row["prefill_s"] == cold["extrapolated"]["ttft_s"] > cold["steps_s"][0]


def test_time_limit_that_the_prefill_keeps_changes_nothing_but_the_step_times(tmp_path):
    argv = ["bench", "prefill", "--model", "tiny", "--device", "cpu", "--contexts", str(CONTEXT),
            "--prefill-chunk", str(CHUNK), "--question", str(QUESTION), "--modes", "locks:hbm", "--no-plain",
            "--time-limit", "600", "--out", str(tmp_path), "--name", "p"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "p.json").read_text())
    row, cold = result["rows"][0], result["points"][0]["result"]["cold"]
    assert row["status"] == "ok" and row["warm_same_tokens"] is True, row
    assert len(cold["steps_s"]) == -(-(CONTEXT + QUESTION) // CHUNK) and "extrapolated" not in cold
    assert row["prefill_s"] == cold["ttft_s"] >= sum(cold["steps_s"]) * 0.999
    share = sum(cold["steps_host_s"]) / sum(cold["steps_s"])
    assert row["host_share"] == pytest.approx(share) and 0 < share <= 1, "on the CPU a step is its host time"
    assert "host / step" in (tmp_path / "p.md").read_text()


def test_time_limit_refuses_what_it_cannot_limit(tmp_path, capsys):
    base = ["bench", "prefill", "--model", "tiny", "--device", "cpu", "--out", str(tmp_path)]
    assert main([*base, "--time-limit", "0"]) != 0
    assert "--time-limit (0.0) must be > 0 seconds" in capsys.readouterr().err
    assert main([*base, "--time-limit", "5", "--beside"]) != 0
    assert "not with --beside" in capsys.readouterr().err


def test_prefill_window_sets_the_engines_window_and_scripts_get_the_parsers_defaults(tmp_path, capsys):
    args = prefill_arguments(prefill_window=4096)
    assert (args.question, args.prefill_chunk, args.summary_eigh) == (48, 8192, "auto")  # the parser's
    assert window_tokens(args, 1 << 20) == 4096
    assert window_tokens(prefill_arguments(), 1 << 20) == (1 << 20) + 48 + 64  # the whole request
    with pytest.raises(ValueError, match=r"bench prefill has no argument \['windw'\]"):
        prefill_arguments(windw=1)
    argv = ["bench", "prefill", "--model", "tiny", "--device", "cpu", "--contexts", str(CONTEXT),
            "--prefill-chunk", "64", "--question", str(QUESTION), "--modes", "locks:host", "--no-plain",
            "--no-warm", "--prefill-window", "128", "--out", str(tmp_path), "--name", "p"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["prefill_window"] == 128 and result["rows"][0]["status"] == "ok", result["rows"]
    kept = result["points"][0]["result"]["stats"]["prefill_kept_pages"]
    assert kept == 128 // 16, f"the window keeps 8 pages of the prompt's 32, not {kept}"
    with pytest.raises(SystemExit) as info:
        main([*argv[:-4], "--prefill-window", "-1", "--out", str(tmp_path)])
    assert info.value.code == 2 and "argument --prefill-window: token count ('-1')" in capsys.readouterr().err
