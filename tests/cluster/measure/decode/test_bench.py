"""`python -m lockserve.cluster.measure.decode.bench` on the CPU (tiny model): its flags and the JSON fields
that docs/results and workers/decode_targets read, per-step hit rates, and offload == resident tokens."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from lockserve.cluster.measure.decode import bench, engines, step_profile


def test_bench_writes_the_fields_its_readers_need(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # torch paths of the cache: seconds, not minutes
    out = tmp_path / "b.json"
    argv = ["--model", "tiny", "--device", "cpu", "--context", "333", "--batch", "2", "--steps", "3",
            "--warmup", "1", "--budget-tokens", "64", "--nvme-dir", str(tmp_path / "nvme"),
            "--modes", "locks:hbm", "locks:host", "locks:host+nvme", "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"][-len(argv):] == argv and result["workload"] == bench.WORKLOADS[True]
    for key in ("commit", "device", "torch", "date", "model", "dtype", "context", "batch", "steps",
                "budget_tokens", "ceilings"):
        assert key in result, key
    for mode, r in result["modes"].items():
        for key in ("tpot_ms_median", "tpot_ms_p90", "tokens_per_s", "hit_rate", "bytes_per_step",
                    "roofline_ms", "tpot_over_roofline", "profile", "step_ms", "tokens",
                    "same_tokens_as_reference", "hit_rate_by_step"):
            assert key in r, (mode, key)
        assert len(r["step_ms"]) == 3 and len(r["tokens"]) == 2
        assert r["tpot_ms_mean"] == pytest.approx(sum(r["step_ms"]) / 3), mode
        assert r["profile"]["graph_span_ms"] is None, "no graphs on the CPU: nothing to time"
        assert r["profile"]["host_ms"] is None, "no replays on the CPU: nothing to split"
        if mode == "locks:hbm":  # the reference: never compared with itself
            assert r["same_tokens_as_reference"] is None and r["token_agreement_with_reference"] is None
        else:
            assert r["same_tokens_as_reference"] is True, mode
    assert result["reference"] == "locks:hbm"
    host = result["modes"]["locks:host"]
    assert len(host["hit_rate_by_step"]) == 3 and result["modes"]["locks:hbm"]["hit_rate_by_step"] is None
    nvme = result["modes"]["locks:host+nvme"]["nvme"]
    assert result["modes"]["locks:host"]["nvme"] is None
    assert {"missed_pages", "step_reruns", "steps_missed", "sync_steps", "spilled_pages"} <= set(nvme)
    assert nvme["spilled_pages_total"] > 0, "host+nvme keeps half the KV on NVMe: pages were spilled"
    assert all(v >= 0 for v in nvme.values()), nvme
    assert list((tmp_path / "nvme").iterdir()) == [], "each run's spill directory is removed"


@pytest.mark.gpu
def test_bench_times_the_graph_replay_on_the_gpu(tmp_path):
    """graph_span_ms: the replays after the traced step, timed by CUDA events, one graph each."""
    out = tmp_path / "b.json"
    argv = ["--model", "tiny", "--device", "cuda", "--context", "2000", "--steps", "4", "--warmup", "2",
            "--budget-tokens", "64", "--modes", "locks:hbm", "locks:host", "--out", str(out)]
    assert bench.main(argv) == 0
    for mode, r in json.loads(out.read_text())["modes"].items():
        span, kernels_ms = r["profile"]["graph_span_ms"], r["profile"]["device_time_us"] / 1e3
        assert isinstance(span, float) and span > 0, (mode, span)
        # one stream, kernels in order: the span holds their summed time (profiler rounding aside)
        assert span >= 0.8 * kernels_ms, (mode, span, kernels_ms)
        assert r["runner"]["graph_replays"] >= 4 + bench.SPAN_STEPS, r["runner"]
        # where the step's wall time goes on the host: before, inside and after the replay call
        host = r["profile"]["host_ms"]
        assert list(host) == ["before_replay", "replay_call", "after_replay"], host
        assert all(v > 0 for v in host.values()), host
        # the after part waits for the graph's kernels on the device
        assert host["after_replay"] + host["replay_call"] >= 0.5 * span, (host, span)


def test_source_commit_prefers_the_environment(monkeypatch):
    """A tree copied to the GPU machine may carry a stale .git: $LOCKSERVE_COMMIT names the run."""
    from lockserve.provenance import source_commit

    monkeypatch.setenv("LOCKSERVE_COMMIT", "abc1234")
    assert source_commit() == "abc1234"
    monkeypatch.delenv("LOCKSERVE_COMMIT")
    commit = source_commit()
    assert commit and all(c in "0123456789abcdef" for c in commit), commit


def test_kernel_gaps_sum_the_idle_time_by_the_kernel_that_waited():
    # (start, end, name) in us, given out of order; b overlaps a (no gap), c waits 3 after b's end
    spans = [(10.0, 12.0, "c"), (0.0, 4.0, "a"), (3.0, 7.0, "b"), (20.0, 21.0, "c"), (12.5, 13.0, "d")]
    gaps = step_profile.kernel_gaps(spans)
    assert gaps["kernel_gaps_us"] == 3.0 + 0.5 + 7.0
    assert gaps["top_gaps"] == [{"before": "c", "count": 2, "total_us": 10.0},
                                {"before": "d", "count": 1, "total_us": 0.5}]
    assert step_profile.kernel_gaps([]) == {"kernel_gaps_us": 0, "top_gaps": []}


def test_hit_rate_recorder_reads_each_steps_counters_from_its_device_history():
    from lockserve.offload.arena import PageGeometry
    from lockserve.offload.cache import HotPageCache

    geometry = PageGeometry(16, 32, torch.bfloat16)
    cache = HotPageCache(geometry, 8, 64, 4, "cpu", ways=4)
    src = torch.zeros((64, *geometry.page_shape), dtype=geometry.dtype)
    recorder = engines.HitRateRecorder(cache, steps=3)
    for slots in ([1, 2, 3, 4], [1, 2, 5, -1], [-1, -1, -1, -1], [1, 2, 3, 4]):  # one step past the history
        cache.lookup_and_fill(torch.tensor(slots), src)
        recorder()
    assert recorder.rates() == [0.0, 2 / 3, None]


def test_repeated_runs_pool_their_steps(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "b.json"
    argv = ["--model", "tiny", "--device", "cpu", "--context", "200", "--steps", "3", "--warmup", "1",
            "--budget-tokens", "64", "--modes", "locks:hbm", "locks:host", "--repeat", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    for mode, r in json.loads(out.read_text())["modes"].items():
        assert len(r["step_ms"]) == 6 and len(r["repeat_tpot_ms"]) == 2, mode
        assert r["tpot_ms_median"] == statistics.median(r["step_ms"]), "the median of the pooled steps"
        assert r["tpot_ms_mean"] == pytest.approx(statistics.fmean(r["step_ms"])), "the pooled steps' mean"
        assert r["repeat_same_tokens"] is True, mode
        assert r["same_tokens_as_reference"] is (None if mode == "locks:hbm" else True), mode
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeat", "0", "--out", str(out)])


def test_isolated_runs_decode_each_mode_in_its_own_process_and_pool_them(tmp_path, monkeypatch):
    """--isolate on: the parent runs no mode itself (run_mode raises here, in this process only),
    each run of each mode is a child process, and the merged file pools them as one process does."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def not_here(*args, **kwargs):
        raise AssertionError("the parent process ran a mode")

    monkeypatch.setattr(bench, "run_mode", not_here)
    out = tmp_path / "b.json"
    argv = ["--model", "tiny", "--device", "cpu", "--context", "200", "--steps", "3", "--warmup", "1",
            "--budget-tokens", "64", "--modes", "locks:hbm", "locks:host", "--repeat", "2", "--isolate", "on",
            "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["isolated"] is True and result["command"][3:] == argv
    assert list(result["modes"]) == ["locks:hbm", "locks:host"]
    for mode, r in result["modes"].items():
        assert len(r["step_ms"]) == 6 and len(r["repeat_tpot_ms"]) == 2, mode
        assert r["tpot_ms_median"] == statistics.median(r["step_ms"]), mode
        assert r["repeat_same_tokens"] is True, mode
        assert r["same_tokens_as_reference"] is (None if mode == "locks:hbm" else True), mode
    assert result["reference"] == "locks:hbm", "the children compare nothing; the parent compares"
    assert bench.isolated(bench.parse_args(["--device", "cuda", "--modes", "locks:hbm", "locks:host",
                                            "--out", str(out)])), "auto: several runs on CUDA"
    one = ["--device", "cuda", "--modes", "locks:hbm", "--out", str(out)]
    assert not bench.isolated(bench.parse_args(one)), "auto: one run stays in this process"
    assert not bench.isolated(bench.parse_args(["--device", "cpu", "--out", str(out)]))


def test_a_mode_is_never_compared_with_itself(capsys):
    """A run whose only mode is its named reference is refused; a reference not among the modes
    too; unnamed, the reference is locks:hbm where it runs beside another mode, else nothing."""
    out = ["--out", "x.json"]
    for argv in (["--modes", "locks:host", "--reference", "locks:host"],
                 ["--modes", "locks:hbm", "locks:hbm", "--reference", "locks:hbm"]):
        with pytest.raises(SystemExit):
            bench.parse_args([*argv, *out])
        assert "holds only the --reference mode" in capsys.readouterr().err, argv
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "locks:host", "--reference", "locks:hbm", *out])
    assert "must be one of --modes (locks:host)" in capsys.readouterr().err
    cases = {("locks:hbm", "locks:host"): "locks:hbm", ("locks:hbm",): None, ("locks:host+nvme",): None,
             ("dense:hbm", "locks:host"): None}
    for modes, reference in cases.items():
        assert bench.parse_args(["--modes", *modes, *out]).reference == reference, modes
    assert bench.parse_args(["--modes", "locks:host", "--reference", "none", *out]).reference is None
    two = bench.parse_args(["--modes", "locks:hbm", "locks:host", "--reference", "locks:host", *out])
    assert two.reference == "locks:host"
    result = {"modes": {"locks:hbm": {"tokens": [[1, 2]]}, "locks:host": {"tokens": [[1, 3]]}}}
    bench.compare_tokens(result, "locks:host")
    assert result["reference"] == "locks:host"
    assert result["modes"]["locks:host"]["same_tokens_as_reference"] is None
    assert result["modes"]["locks:hbm"]["same_tokens_as_reference"] is False
    assert result["modes"]["locks:hbm"]["token_agreement_with_reference"] == 0.5


def _engines_made(monkeypatch) -> list:
    """The engines engines.make_engine builds from now on (appended as they are made)."""
    made, make = [], engines.make_engine

    def recording(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(engines, "make_engine", recording)
    return made


@pytest.mark.parametrize("flags,want", [
    ([], {"radix_bits": 1, "summary_eigh": "auto", "commit": None}),
    (["--radix-bits", "2", "--summary-eigh", "torch", "--cache-commit", "launch"],
     {"radix_bits": 2, "summary_eigh": "torch", "commit": "launch"}),
])
def test_kernel_flags_reach_the_engine_as_config_and_are_recorded(tmp_path, monkeypatch, flags, want):
    """--radix-bits, --summary-eigh and --cache-commit become cache config fields of each mode's
    engine (no module global set, no attribute patched after construction), and the file says so."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    made = _engines_made(monkeypatch)
    out = tmp_path / "b.json"
    argv = ["--model", "tiny", "--device", "cpu", "--context", "200", "--steps", "2", "--warmup", "1",
            "--budget-tokens", "64", "--modes", "locks:hbm", "locks:host", *flags, "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    assert (result["radix_bits"], result["summary_eigh"]) == (want["radix_bits"], want["summary_eigh"])
    assert [e.cache_config.tier for e in made] == ["hbm", "host"]
    for engine in made:
        assert engine.attention.radix_bits == want["radix_bits"]
        assert engine.kv.summaries.cfg.eigh == want["summary_eigh"]
    assert engines.hot_cache(made[1]).commit == (want["commit"] or "inline")
    for bad in (["--radix-bits", "4"], ["--summary-eigh", "lapack"], ["--cache-commit", "later"]):
        with pytest.raises(SystemExit):
            bench.parse_args([*bad, "--out", str(out)])
