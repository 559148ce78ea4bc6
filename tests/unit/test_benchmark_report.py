"""The benchmark scripts write their own pages under docs/benchmarks/, keeping every earlier measurement."""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "tools" / "benchmarks"
#: the scripts' shared modules (helpers, no page of their own): the rest are benchmarks
SHARED = ("aux_only", "common", "kept_side", "report", "trace_gaps")
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if p.stem not in SHARED)


def _report():
    spec = importlib.util.spec_from_file_location("bench_report", BENCHMARKS / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_new_measurement_becomes_latest_and_the_previous_one_moves_down(tmp_path, monkeypatch):
    """Two runs: the page's latest block holds the second figures, the earlier blocks the first."""
    report = _report()
    monkeypatch.setenv("SPECULATORS_BENCH_PAGES", str(tmp_path))
    monkeypatch.setenv("SPECULATORS_BENCH_MACHINE", "a test machine")
    report.write_page("demo_bench", "What it measures.", ["--rounds", "1"], "first: 1.00x\n")
    path = report.write_page("demo_bench", "What it measures.", ["--rounds", "2"], "second: 2.00x\n")
    text = path.read_text()
    latest = text[text.index(report.LATEST[0]) : text.index(report.LATEST[1])]
    earlier = text[text.index(report.EARLIER[0]) : text.index(report.EARLIER[1])]
    assert "second: 2.00x" in latest and "first: 1.00x" not in latest
    assert "first: 1.00x" in earlier and "--rounds 1" in earlier and "(none)" not in earlier
    assert "`python tools/benchmarks/demo_bench.py --rounds 2`" in latest
    assert "a test machine" in latest and re.search(r"### \d{4}-\d\d-\d\d \d\d:\d\d UTC", latest)
    report.write_page("demo_bench", "What it measures.", [], "third\n")
    text = path.read_text()
    assert text.index("second: 2.00x") < text.index("first: 1.00x")  # newest of the earlier ones first


def test_recording_tees_what_is_printed_into_the_page(tmp_path, monkeypatch, capsys):
    """What the block prints reaches the terminal and the page; a failing block writes nothing."""
    report = _report()
    monkeypatch.setenv("SPECULATORS_BENCH_PAGES", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["tee_bench.py", "--small"])
    with report.recording("tools/benchmarks/tee_bench.py", "Tees."):
        print("ratio 0.95x")
    assert "ratio 0.95x" in capsys.readouterr().out
    assert "ratio 0.95x" in (tmp_path / "tee_bench.md").read_text()
    try:
        with report.recording("tools/benchmarks/broken_bench.py", "Breaks."):
            print("half a table")
            raise RuntimeError("measurement failed")
    except RuntimeError:
        pass
    assert not (tmp_path / "broken_bench.md").exists()


def test_every_benchmark_script_records_its_page_and_has_one():
    """Each script in tools/benchmarks/ calls the shared recorder, and docs/benchmarks/ holds its page."""
    assert SCRIPTS
    for script in SCRIPTS:
        assert "with recording(__file__" in script.read_text(), f"{script.name} does not write its page"
        page = ROOT / "docs" / "benchmarks" / f"{script.stem}.md"
        assert page.exists(), f"no page {page.relative_to(ROOT)}"
        assert "<!-- measurement:begin -->" in page.read_text()
        assert f"[{script.stem}]({script.stem}.md)" in (ROOT / "docs" / "benchmarks" / "README.md").read_text()


def test_a_second_measurement_of_a_script_goes_to_its_own_page(tmp_path, monkeypatch):
    """``name=``: the page is ``name``.md, its command still the script's; the script's own page is untouched."""
    report = _report()
    monkeypatch.setenv("SPECULATORS_BENCH_PAGES", str(tmp_path))
    report.write_page("demo_bench", "What it measures.", [], "single: 1.00x\n")
    path = report.write_page("demo_bench", "The other mode.", ["--other"], "other: 2.00x\n", "demo_bench_other")
    assert path == tmp_path / "demo_bench_other.md"
    assert "`python tools/benchmarks/demo_bench.py --other`" in path.read_text()
    own = (tmp_path / "demo_bench.md").read_text()
    assert "single: 1.00x" in own and "other: 2.00x" not in own
