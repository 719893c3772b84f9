"""`lockserve report`'s checks on small hand-made result folders: the audit of provenance and of
modes compared with themselves, the reference row's cell, the blocks of several kinds on one page,
--check failing on a figure that no result file holds, and the archive (history, not evidence)."""

from __future__ import annotations

import json
from pathlib import Path

from lockserve.cluster.cli import main
from lockserve.cluster.measure import report, report_checks

PROVENANCE = {"commit": "abc1234", "command": ["python", "-m", "x"], "device": "NVIDIA H200",
              "torch": "2.11.0"}


def write(folder: Path, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps(data))


def decode_file(modes: dict[str, bool | None], **extra) -> dict:
    return {**PROVENANCE, "model": "tiny", "workload": "synthetic", "context": 1024, "batch": 1,
            "budget_tokens": 64, **extra,
            "modes": {m: {"tpot_ms_median": 1.0 + i, "same_tokens_as_reference": same}
                      for i, (m, same) in enumerate(modes.items())}}


def test_the_audit_names_what_each_file_lacks(tmp_path):
    write(tmp_path, "good.json", decode_file({"locks:hbm": None, "locks:host": True}, reference="locks:hbm"))
    write(tmp_path, "no_commit.json", {k: v for k, v in PROVENANCE.items() if k != "commit"})
    nested = {"commit": "abc", "command": "x", "machine": {"torch": "2", "gpu": "H200"}}
    write(tmp_path, "nested.json", nested)
    command = ["b", "--modes", "locks:host", "--reference", "locks:host"]
    write(tmp_path, "self_only.json", decode_file({"locks:host": True}, command=command))
    write(tmp_path, "old_reference_row.json", decode_file({"locks:hbm": True, "locks:host": True}))
    (tmp_path / "log.txt").write_text("12 passed\n")
    found = {f.name: f for f in report_checks.audit(tmp_path)}
    assert set(found) == {"no_commit.json", "self_only.json", "old_reference_row.json", "log.txt"}
    assert found["no_commit.json"].lacks == ("commit",) and found["no_commit.json"].stale
    assert "compared with itself" in found["self_only.json"].says() and found["self_only.json"].stale
    old = found["old_reference_row.json"]
    assert not old.stale and "locks:hbm" in old.reference_row, "its other rows' comparisons stand"
    assert found["log.txt"].stale
    section = report_checks.audit_section(tmp_path)
    assert "| `self_only.json` | its only mode (locks:host) is its reference" in section
    assert "`nested.json`" not in section and "`good.json`" not in section


def test_the_reference_row_says_reference_never_yes(tmp_path):
    """Old files stored True on the reference's own row; the report shows "reference" there, and
    compared rows say yes / no."""
    old = decode_file({"dense:hbm": None, "locks:hbm": True, "locks:host": False})
    write(tmp_path, "decode_old.json", old)
    write(tmp_path, "decode_named.json", decode_file({"locks:hbm": False, "locks:host": None},
                                                     reference="locks:host"))
    files = report.load_results(tmp_path)["bench"]
    rows = {(r["file"], r["mode"]): r["same_tokens"] for r in report.bench_rows(files)}
    assert rows == {("decode_named.json", "locks:hbm"): "no",
                    ("decode_named.json", "locks:host"): "reference",
                    ("decode_old.json", "dense:hbm"): None, ("decode_old.json", "locks:hbm"): "reference",
                    ("decode_old.json", "locks:host"): "no"}


def test_stale_files_are_marked_in_the_results_log(tmp_path):
    write(tmp_path, "decode_self.json", decode_file({"locks:host": None}, reference="locks:host",
                                                    commit=None))
    section = report.render(tmp_path, tmp_path)
    assert "Stale files" in section and "`decode_self.json`" in section
    [row] = [line for line in section.splitlines() if line.startswith("| `decode_self.json`")]
    assert "| stale |" in row and row.endswith("| reference |")


def test_a_stale_file_gives_its_headline_row_no_verdict(tmp_path):
    row = {"mode": "locks:hbm", "context": 32768, "status": "ok", "prefill_s": 1.5, "x_plain": 1.1,
           "warm_ttft_s": 0.05, "warm_same_tokens": True}
    prefill = {**PROVENANCE, "rows": [row]}
    name = report.PREFILL_HEADLINE[0]
    write(tmp_path, name, prefill)
    [(_, _, file, ok)] = report.headline_rows(tmp_path, report_checks.stale_names(tmp_path))
    assert (file, ok) == (f"`{name}`", "met")
    write(tmp_path, name, {k: v for k, v in prefill.items() if k != "commit"})
    [(_, _, file, ok)] = report.headline_rows(tmp_path, report_checks.stale_names(tmp_path))
    assert (file, ok) == (f"`{name}` (stale)", report.NO_VERDICT)


def page(head: str, kinds: list[str], tail: str = "") -> str:
    blocks = "".join(f"{report.markers(k)[0]}\nold\n{report.markers(k)[1]}\n" for k in kinds)
    return f"{head}\n{blocks}{tail}"


def test_check_fails_on_a_figure_no_result_file_holds(tmp_path, capsys):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    write(results, "run.json", {**PROVENANCE, "prefill_s": 13.5412, "samples": [55.55, 66.66]})
    (results / "run.md").write_text("| mode | x plain |\n| --- | --- |\n| locks:hbm | 1.144 |\n")
    readme = tmp_path / "README.md"
    backed = "A prefill took 13.54 s (1.144 x; 13.5 s rounded), 1,024 tokens, a 2 x target."
    readme.write_text(page(backed, ["headline"]))
    args = ["report", "--readme", str(readme), str(results)]
    assert main(args) == 0 and main([*args, "--check"]) == 0, capsys.readouterr().out
    for figure in ("99.99 ms", "55.55 ms", "1.14 x", "13.55 s", "1.1 x"):  # 55.55: a sample backs nothing
        readme.write_text(page(f"{backed} Also {figure}.", ["headline"]))
        assert main(args) == 0
        capsys.readouterr()
        assert main([*args, "--check"]) == 1, figure
        out = capsys.readouterr().out
        assert f"'{figure}' is in no result file" in out, (figure, out)


def test_a_page_in_the_results_folder_is_not_checked_for_figures(tmp_path, capsys):
    """The results log keeps the log's prose as it was written; its blocks are checked, its figures not."""
    write(tmp_path, "run.json", PROVENANCE)
    log = tmp_path / "README.md"
    log.write_text(page("Earlier: 23.8 ms, as committed then.", ["", "audit"]))
    args = ["report", "--readme", str(log), str(tmp_path)]
    assert main([*args, "--check"]) == 1, "stale blocks"
    assert main(args) == 0 and main([*args, "--check"]) == 0
    text = log.read_text()
    assert report.NOTE in text and "Stale: 0 files" in text and "23.8 ms" in text


COMPARED = {"locks:hbm": None, "locks:host": True}  # a decode file's modes: host compared with hbm


def archive_of(results: Path) -> Path:
    """results/archive/ holding a file with no commit, a typed test log and a complete decode file."""
    archive = results / report_checks.ARCHIVE
    archive.mkdir(parents=True)
    write(archive, "probe_old.json", {k: v for k, v in PROVENANCE.items() if k != "commit"} | {"us": 42.4242})
    (archive / "gpu_tests_typed.txt").write_text("# pytest on the H200: 12 passed\n")
    write(archive, "decode_old.json", decode_file(COMPARED, reference="locks:hbm"))
    return archive


def test_an_archived_file_is_listed_in_the_audit_and_never_stale(tmp_path):
    write(tmp_path, "no_torch.json", {k: v for k, v in PROVENANCE.items() if k != "torch"})
    archive_of(tmp_path)
    assert [f.name for f in report_checks.audit(tmp_path)] == ["no_torch.json"]
    assert report_checks.stale_names(tmp_path) == {"no_torch.json"}
    section = report_checks.audit_section(tmp_path)
    stale_part, archived_part = section.split("Archived: ")
    assert "Stale: 1 files" in stale_part and "probe_old" not in stale_part, section
    assert archived_part.startswith("3 files under `archive/`, kept for the history that docs/notes cite, "
                                    "not evidence"), section
    rows = [line for line in archived_part.splitlines() if line.startswith("| `")]
    assert rows == ["| `decode_old.json` | - |",
                    "| `gpu_tests_typed.txt` | lacks commit, command, device and torch fields (a text log "
                    "without a `# provenance:` line: its provenance is what its text says) |",
                    "| `probe_old.json` | lacks commit |"], rows
    assert "Archived" not in report_checks.audit_section(tmp_path / report_checks.ARCHIVE), "no archive there"


def test_an_archived_file_is_in_no_table_and_backs_no_figure(tmp_path, capsys):
    results = tmp_path / "docs" / "results"
    archive = archive_of(results)
    write(results, "decode_now.json", decode_file(COMPARED, reference="locks:hbm"))
    log = report.render(results, results)
    assert "Archived: 3 files under [archive/](archive/)" in log, log
    assert "`decode_now.json`" in log and "decode_old" not in log and "Stale files" not in log, log
    readme = tmp_path / "README.md"
    readme.write_text(page("A lookup took 42.42 us.", ["headline"]))
    args = ["report", "--readme", str(readme), str(results)]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--check"]) == 1, "42.42 us is only in an archived file"
    assert "'42.42 us' is in no result file" in capsys.readouterr().out
    (archive / "probe_old.json").rename(results / "probe_old.json")
    assert main(args) == 0 and main([*args, "--check"]) == 0, "out of the archive, the file backs it"


def test_a_subfolder_is_no_result_file_whatever_its_name(tmp_path):
    write(tmp_path, "run.json", PROVENANCE)
    (tmp_path / "notes.json").mkdir()
    (tmp_path / "notes.json" / "inner.json").write_text('{"us": 7.5}')
    assert report_checks.audit(tmp_path) == [], "a folder is not an unreadable JSON file"
    evidence = report_checks.Evidence.of(tmp_path, [])
    assert evidence.numbers == [] and not evidence.backs("7.5"), "run.json holds no number; none else read"
    assert [p.name for p in report_checks.result_files(tmp_path)] == ["run.json"]


def test_a_test_log_with_a_provenance_line_is_audited_like_a_json_file(tmp_path):
    """scripts/gpu_tests.py heads pytest's output with `# provenance: {...}`; the audit reads it and
    names the fields it lacks; a log without that line lacks them all."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    log = tmp_path / "gpu_tests_here.txt"
    code = subprocess.run([sys.executable, str(repo / "scripts" / "gpu_tests.py"), str(log), "-q",
                           "-p", "no:cacheprovider", str(repo / "tests" / "cluster" / "measure" /
                                                         "test_report.py"), "-k", "reference_row_says"],
                          cwd=repo, capture_output=True, text=True, timeout=300).returncode
    text = log.read_text()
    assert code == 0 and "1 passed" in text and text.endswith("# exit status: 0\n"), text
    assert str(repo) not in text and sys.prefix not in text, "no path of this machine in a result file"
    header = report_checks.log_provenance(log)
    assert header["command"][:3] == ["python", "-m", "pytest"] and header["device"] == "cpu", header
    assert header["commit"] and header["torch"], header
    assert not report_checks.audit(tmp_path), "every field is there"
    lines = text.splitlines()
    lines[0] = lines[0].replace('"torch"', '"torch_version"')
    (tmp_path / "renamed.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "typed.txt").write_text("# pytest on the H200: 12 passed\n")
    found = {f.name: f for f in report_checks.audit(tmp_path)}
    assert found["renamed.txt"].lacks == ("torch",), found
    assert found["typed.txt"].stale and "without a `# provenance:` line" in found["typed.txt"].says()


def test_a_test_log_names_the_carried_wheels_folder_site(monkeypatch, tmp_path):
    """A GPU machine's PYTHONPATH folders (the carried wheels, scripts/gpu_env.sh) are written
    `<site>`, nested under the working directory or not; the working directory stays `.`."""
    import importlib.util

    repo = Path(__file__).resolve().parents[3]
    spec = importlib.util.spec_from_file_location("gpu_tests_script", repo / "scripts" / "gpu_tests.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    site, nested = tmp_path / "site", tmp_path / "work" / "wheels"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", f"{site}:{nested}:{tmp_path}")
    line = f'File "{site}/tqdm/_monitor.py" and "{nested}/x.py" in {tmp_path}/tests'
    assert script.without_paths(line) == 'File "<site>/tqdm/_monitor.py" and "<site>/x.py" in ./tests'
    failed = f"tmp_path = PosixPath('{script.pytest_temp_root()}/pytest-3/test_x0')"
    assert script.without_paths(failed) == "tmp_path = PosixPath('<pytest-tmp>/pytest-3/test_x0')"


def test_prefill_headline_rows_give_each_target_its_verdict():
    def row(mode, ratio, warm=0.05, same=True, **extra):
        column = "x_plain" if mode == "locks:hbm" else "x_hbm"
        return {"mode": mode, "context": 32768, "status": "ok", "prefill_s": 1.5, column: ratio,
                "warm_ttft_s": warm, "warm_same_tokens": same, **extra}

    result = {"rows": [row("locks:hbm", 1.14), row("locks:host", 1.11), row("locks:host+nvme", 1.2, warm=0.4),
                       row("locks:host+nvme", 1.2, same=False), row("dense:hbm", 1.0),
                       row("locks:hbm", 1.0, status="out of memory")]}
    verdicts = [(what.split("prompt: ")[1].split(" prefill")[0], ok) for what, _, _, ok in
                report.prefill_rows(result, "p.json")]
    assert verdicts == [("locks:hbm", "met"), ("locks:host", "**missed**"), ("locks:host+nvme", "**missed**"),
                        ("locks:host+nvme", "**missed**")]
    got = report.prefill_rows({"rows": [row("locks:host+nvme", 1.249)]}, "p.json")[0]
    assert got[1] == "1.50 s = 1.249 x; warm request 0.050 s, same tokens yes" and got[3] == "met"


def test_beside_headline_rows_judge_tpot_beside_against_alone_and_name_the_card():
    def row(beside, alone, status="ok"):
        return {"mode": "locks:hbm", "context": 131072, "status": status, "tpot_beside_p99_ms": beside,
                "tpot_alone_p99_ms": alone}

    result = {"device": "NVIDIA H100 80GB HBM3",
              "rows": [row(13.8, 7.6), row(23.0, 7.6), row(5.0, 7.6, status="out of memory"),
                       {"mode": "locks:host", "context": 131072, "status": "ok"}]}
    got = report.beside_rows(result, "b.json")
    assert [ok for _, _, _, ok in got] == ["met", "**missed**"], got
    assert got[0][1] == "13.80 / 7.60 ms = 1.82 x (H100 80GB HBM3)" and "128K prompt" in got[0][0], got
