"""The exit code and the one message of a failed run, whatever else fails while reporting it."""

import errno
import io
import sys
from types import SimpleNamespace

import pytest

from speculators_v016.run import huge_pages, run_report
from speculators_v016.run.console import Console
from speculators_v016.run.mid_run import MIN_STEPS, MidRun
from speculators_v016.run.pipeline import RunSummary, SelfCheckError
from speculators_v016.run.run_report import exit_code, run_and_report
from speculators_v016.store.manifest import ManifestError


@pytest.mark.parametrize(
    "exc, code",
    [
        (OSError(errno.ENOSPC, "No space left on device", "/out/logs"), 6),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), 6),
        (ManifestError("/out/manifest.jsonl:2: not a manifest entry"), 4),
        (SelfCheckError("self-check failed"), 7),
        (RuntimeError("engine died"), 5),
    ],
)
def test_exit_codes_by_kind(exc, code):
    """A full disk anywhere is 6, a manifest we did not write 4, a failed self-check 7, the rest 5."""
    assert exit_code(exc) == code


class _Full(io.StringIO):
    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")


def opts():
    return SimpleNamespace(progress=False, num_shards=1, deep_verify=False)


def test_a_failure_with_a_full_log_keeps_its_exit_code_and_one_message(monkeypatch, capsys):
    """The traceback cannot go to the full log: the exit code stays the error's, one message, no traceback."""

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/out/data_3.safetensors")

    monkeypatch.setattr(run_report, "run", fail)  # the pipeline's run, as run_report calls it
    console = Console(None)
    monkeypatch.setattr(sys, "stderr", _Full())  # the log's descriptor, on a full disk
    code = run_and_report(opts(), console)
    monkeypatch.undo()
    assert code == 6
    err = capsys.readouterr().err
    assert err == "error: cannot write /out/data_3.safetensors: No space left on device\n"


def test_a_post_run_verify_that_raises_is_reported_not_a_traceback(monkeypatch, capsys, tmp_path):
    """The post-run verify runs under the run's error handling: a message and exit 1, never a traceback."""
    monkeypatch.setattr(run_report, "run", lambda *a, **k: RunSummary(str(tmp_path)))

    def broken(*args, **kwargs):
        raise KeyError("format")

    monkeypatch.setattr(run_report, "verify", broken)  # the store's verify, as run_report calls it
    code = run_and_report(opts(), Console(None))
    assert code == 1
    captured = capsys.readouterr()
    assert "verify:     could not run (KeyError: 'format')" in captured.err
    assert "written:    0 samples" in captured.out


def test_the_summary_says_where_the_host_time_went(tmp_path):
    """The summary's host line names the engine thread's waits and copies, the writers' load and the pool's blocks."""
    summary = RunSummary(str(tmp_path))
    assert not [line for line in summary.lines() if line.startswith("host path:")]
    summary.host = {"engine_stepped": 3.25, "engine_copied": 1.5, "waited": 0.4, "workers": 8, "busy": 0.625,
                    "blocks_made": 20, "blocks_reused": 236}  # fmt: skip
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert "spent 3.2 s in vLLM's steps, copied rows for 1.5 s and waited 0.4 s for the writers" in line
    assert "8 write workers busy 62% of the time; buffer pool: 20 blocks made, 236 reused" in line
    assert line.endswith("236 reused")  # a GPU engine's run: every sample pooled, nothing said of fresh memory
    summary.host.update(drainers=4)  # close() added threads for the samples still queued
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert "8 write workers busy 62% of the time, 4 more for the last samples;" in line
    summary.host.update(drainers=0)
    summary.host.update(blocks_made=0, blocks_reused=0, samples_fresh=64, cpu_seconds=43.06, drain_seconds=0.44)
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert line.endswith(
        "buffer pool: 0 blocks made, 0 reused, 64 samples in fresh memory (CPU engine); this process used 43.1 CPU-s "
        "(user + system); the last files were made durable 0.44 s after the engine's last sample"
    )
    summary.host.update(glibc_tunables="glibc.malloc.hugetlb=1")  # a CPU engine's process, glibc asked for huge pages
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert "(CPU engine); glibc asked for transparent huge pages (SPECULATORS_V016_HUGE_PAGES=0 to not); " in line
    summary.host.update(glibc_tunables=huge_pages.plan({}, vllm_version="0.16.0+cpu", thp="madvise", glibc=(2, 36)))
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert (
        "(CPU engine); glibc asked for transparent huge pages and a kept heap (SPECULATORS_V016_HUGE_PAGES=0 to not); "
        in line
    )
    summary.host.update(glibc_tunables="")
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert "(CPU engine); glibc not asked for huge pages nor a kept heap (see docs/commands/run.md); " in line
    summary.host.update(on_cpu=0.5, cpu_per_gib=1.234)  # the writers' own CPU time
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert "8 write workers busy 62% of the time (on a CPU 50% of it, 1.23 CPU-s per GiB written); buffer" in line
    summary.host.update(batched=8)  # a CPU engine's writers, under SCHED_BATCH
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert "8 write workers (SCHED_BATCH) busy 62% of the time (on a CPU 50%" in line
    summary.host.update(batched=0)
    summary.host.update(finite_proven=250, finite_tested=6)  # a GPU engine's staged run: the device's NaN/Inf proof
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert "GiB written); NaN/Inf test: 250 samples proven on the device, 6 tested by the writers; buffer" in line
    summary.host.update(engine_copied=0.25, copy_thread=2.6, copy_waited=0.125)  # a GPU engine's copy thread
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert (
        "spent 3.2 s in vLLM's steps, handed rows to the copy thread for 0.2 s (it copied for 2.6 s; the engine's "
        "thread waited 0.1 s for it) and waited 0.4 s for the writers" in line
    )


def test_the_mid_run_rate_is_the_forwards_between_half_and_nine_tenths_of_the_samples():
    """MidRun times the tokens computed between the samples passing half and nine tenths of the run's; None without
    both marks, with both at one reading, or with fewer than MIN_STEPS steps between them."""
    now = [0.0]
    marks = MidRun(10, started=0.0, clock=lambda: now[0])
    # (samples handed, tokens computed, steps, s): samples come late and the last ones at once, the forward ahead
    for handed, computed, steps, at in ((1, 3000, 6, 5.0), (5, 5000, 10, 9.0), (7, 7000, 14, 10.0),
                                        (9, 9000, 18, 11.0), (10, 10000, 20, 11.0)):  # fmt: skip
        now[0] = at
        marks.passed(handed, computed, steps)
    assert marks.at == [(5000, 10, 9.0), (9000, 18, 11.0)]
    assert marks.rate() == (9000 - 5000) / (11.0 - 9.0)
    few = MidRun(10, started=0.0, clock=lambda: now[0])
    few.passed(5, 5000, 10)
    few.passed(9, 9000, 10 + MIN_STEPS - 1)  # a step's granularity would make most of the figure
    assert few.rate() is None
    one = MidRun(10, started=0.0, clock=lambda: 4.0)
    one.passed(10, 10000, 20)  # both marks at one reading: no interval to time
    assert one.rate() is None
    unknown = MidRun(None, started=0.0)  # --regenerate: the samples are not known before the run
    unknown.passed(10**6, 10**9, 10**4)
    assert unknown.rate() is None


def test_the_summary_says_the_mid_run_rate(tmp_path):
    """The host line ends with the rate from half to nine tenths of the tokens, where the run timed it."""
    summary = RunSummary(str(tmp_path))
    summary.host = {"engine_stepped": 3.25, "engine_copied": 1.5, "waited": 0.4, "workers": 8, "busy": 0.625,
                    "blocks_made": 20, "blocks_reused": 236, "drain_seconds": 0.44, "mid_run_rate": 3212.4}  # fmt: skip
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert line.endswith("after the engine's last sample; from half to nine tenths of the tokens at 3,212 tokens/s")
    summary.host["mid_run_rate"] = None
    (line,) = [line for line in summary.lines() if line.startswith("host path:")]
    assert "nine tenths" not in line
