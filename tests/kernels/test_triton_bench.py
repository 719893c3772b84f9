"""The kernel benchmark's command line: --dry-run, and a --tiny run on whatever Triton runs on here."""

from __future__ import annotations

import json

import pytest
from lockserve.kernels import bench

from tests.conftest import triton_devices

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def test_dry_run_prints_the_llama_plan(capsys):
    assert bench.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1048576 tokens: 65536 pages/head" in out
    assert "818 B per page-head" in out  # int4 basis + int8 coef/centroid + fp16 scales, d 128, r 8
    assert "attention batch 64: 128 pages per head, 512.0 MiB" in out


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit, match="unknown sections"):
        bench.main(["--dry-run", "--only", "score,nope"])


@pytest.mark.skipif(not triton_devices(), reason="needs CUDA or TRITON_INTERPRET=1")
def test_tiny_run_writes_results(tmp_path):
    out = tmp_path / "k.json"
    device = triton_devices()[0]
    args = ["--tiny", "--no-sweep", "--device", device, "--only", "score,attention", "--out", str(out)]
    assert bench.main(args) == 0
    r = json.loads(out.read_text())
    assert r["errors"] == [], r["errors"]
    assert r["command"][:3] == ["python", "-m", "lockserve.kernels.bench"] and r["command"][3:] == args
    assert [(row["tokens"], row["batch"]) for row in r["score"]] == [(256, 1), (256, 2), (512, 1), (512, 2)]
    assert [row["batch"] for row in r["attention"]] == [1, 2]
    for check in r["check"]:
        if check["kernel"] == "score":
            assert check["s_hat_max_abs_err"] < 1e-4 * max(1.0, check["s_hat_max_abs"]), check
            assert check["m_bar_max_abs_err"] < 1e-5, check
        else:
            assert check["o_max_abs_err"] < 2e-2 and check["lse_max_abs_err"] < 2e-2, check
    assert set(r["targets"]) == {"score_kernel", "attention_kernel"}
