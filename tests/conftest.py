"""Fixtures of every tier: tiny real models on disk, the architecture table, the shared-memory guard.

Engines are module-scoped in the test modules (start-up is the slow part);
models are built once per session.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per CPU engine
os.environ.setdefault("VLLM_MLA_DISABLE", "1")  # DeepSeek on CPU: plain attention (the CPU backend has no MLA)
if "SPECULATORS_DATA_GEN_PREPARED_CACHE" not in os.environ:  # the runs' prepared rows: never the user's own cache
    import tempfile

    os.environ["SPECULATORS_DATA_GEN_PREPARED_CACHE"] = tempfile.mkdtemp(prefix="speculators-tests-prepared-")

import fcntl
import json
from pathlib import Path

import pytest

from speculators_v016.protocol import PREFIX, SHM_DIR
from speculators_v016.shared.shm_records import reclaim


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Build (once) and return the folder of a tiny model of the given architecture (and layer count)."""
    # every pytest process loads this file (the xdist controller too): transformers only where models are built
    from helpers.reference import NUM_LAYERS  # noqa: PLC0415 - transformers, see above
    from speculators_v016.testing.tiny_models import build_tiny_model  # noqa: PLC0415 - transformers, see above

    built: dict[tuple[str, int], str] = {}

    def get(arch: str, num_layers: int = NUM_LAYERS) -> str:
        if (arch, num_layers) not in built:
            where = tmp_path_factory.mktemp(f"{arch}-{num_layers}")
            built[arch, num_layers] = str(build_tiny_model(where, arch, num_layers=num_layers))
        return built[arch, num_layers]

    return get


@pytest.fixture(scope="session")
def model_dir(tiny_model):
    """The tiny Llama most tests run on."""
    return tiny_model("llama")


@pytest.fixture(scope="session")
def zero_embedding_model(tiny_model, tmp_path_factory):
    """The tiny Llama with token ``ZERO_TOKEN``'s input embedding row zeroed (as real checkpoints have rows)."""
    import shutil  # noqa: PLC0415 - as tiny_model's imports: only where models are built

    from helpers import ZERO_TOKEN  # noqa: PLC0415 - as tiny_model's imports
    from speculators_v016.testing.tiny_models import zero_embedding_rows  # noqa: PLC0415 - transformers, see above

    out = tmp_path_factory.mktemp("zero-embedding") / "llama"
    shutil.copytree(tiny_model("llama"), out)
    zero_embedding_rows(out, [ZERO_TOKEN])
    return str(out)


# -- the architecture table: each engine test of a model family records its result ------------
@pytest.fixture
def record_architecture():
    """record(name, model_class, aux_source, tested, max_abs_error, tolerance, note, dtype, device) for
    docs/architectures.md.

    A float32 result is the family's row; another dtype's is kept beside it (``name@dtype``) for its column,
    and a GPU's (``name@dtype@cuda``) for the GPU column.
    """

    def record(
        name,
        model_class,
        aux_source,
        tested,
        max_abs_error=None,
        tolerance=None,
        note="",
        dtype="float32",
        device="cpu",
    ):
        key = (name if dtype == "float32" else f"{name}@{dtype}") + ("" if device == "cpu" else f"@{device}")
        result = dict(
            device=device,
            name=name,
            model_class=model_class,
            aux_source=aux_source,
            tested=tested,
            max_abs_error=max_abs_error,
            tolerance=tolerance,
            note=note,
            dtype=dtype,
        )
        _save_architectures({key: result})  # at once: a run stopped at its limit keeps it

    return record


def _save_architectures(results: dict[str, dict]) -> None:
    """Merge ``results`` into build/test-results/architectures.json (tools/architecture_table.py reads it)."""
    out = Path(__file__).resolve().parents[1] / "build" / "test-results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "architectures.json"
    with open(out / ".architectures.lock", "w") as lock:  # xdist workers write at about the same time
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**old, **results}, indent=2, sort_keys=True) + "\n")


_SHM_BEFORE: set[str] = set()


def _shm_left() -> set[str]:
    """What a run of ours left in /dev/shm: dead runs' recorded segments still there, and ring files of
    dead processes (a ring is unlinked once the worker mapped it)."""
    left = {
        f"{seg.name} (recorded by dead run {run.run})"
        for run in reclaim(SHM_DIR, delete=False).runs
        if not run.alive
        for seg in run.segments
        if seg.delete
    }
    for name in os.listdir(SHM_DIR):
        pid = name.removeprefix(PREFIX).split("-")[0]
        if name.startswith(PREFIX) and not (pid.isdigit() and os.path.exists(f"/proc/{pid}")):
            left.add(f"{name} (a capture ring of a dead process)")
    return left


def _xdist_worker(session) -> bool:
    """Is this session a pytest-xdist worker? The /dev/shm guard runs in the controller (or a plain run),
    once every worker is done: a worker would see the other's runs at work."""
    return hasattr(session.config, "workerinput")


def pytest_sessionstart(session):
    if not _xdist_worker(session):
        _SHM_BEFORE.update(_shm_left())


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if it left shared memory behind."""
    if not _xdist_worker(session):
        left = sorted(_shm_left() - _SHM_BEFORE)
        if left:
            print(f"\nFAILED: this test run left shared memory in /dev/shm: {left}")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test's setup, call and teardown seconds, summed by file (the xdist controller receives them all)."""
    name = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The 12 files that took longest in this round (a whole file runs on one worker: what a round's length
    is made of, for keeping CI under its limit), and all of its files' seconds summed: against the round's wall
    time and its workers, how evenly the files were spread."""
    if _FILE_SECONDS:
        terminalreporter.write_sep("=", "slowest files (seconds, setup + call + teardown)")
        for name, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:12]:
            terminalreporter.write_line(f"{seconds:8.1f}s  {name}")
        terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}s  all {len(_FILE_SECONDS)} files")


#: The in-process round's longest files (seconds on a 2-core CI clone, 2026-12-04), started first: a long file
#: left to the end of a round runs alone while the other worker idles (tests/engine/test_tensor_parallel.py did,
#: for minutes). tools/test.sh keeps this order in that round (--no-loadscope-reorder); other files keep theirs.
LONGEST_FIRST = (
    "tests/engine/test_pipeline_parallel.py",  # 380 s
    "tests/engine/test_model_families_bf16.py",  # 321 s
    "tests/engine/test_tensor_parallel.py",  # 280 s (139 s alone)
    "tests/engine/test_model_families.py",  # 267 s
    "tests/engine/test_regenerate_engine.py",  # 193 s
    "tests/engine/test_memory_bound.py",  # 124 s
    "tests/engine/test_generator_consistency.py",  # 103 s
    "tests/engine/test_generator_architectures.py",  # 102 s
    "tests/distribution/test_distribution.py",  # 77 s
    "tests/engine/test_stream_proof_engine.py",  # 76 s
)


def pytest_collection_modifyitems(items):
    """The files of LONGEST_FIRST first, in its order; every other file after them in its own order (a file's tests
    keep theirs)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    last = len(LONGEST_FIRST)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], last))  # stable: the rest as collected
