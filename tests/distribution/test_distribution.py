"""The assembled distribution: upstream's API, console script, wheel, pinned artifact."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from loguru import logger

import speculators_v016

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from patchtool.artifact import LOCAL_ARTIFACT_ENV, ArtifactError, Pin, fetch  # noqa: E402

PIN = Pin.load(ROOT / "patches" / "upstream.json")
SCRIPT = Path(sys.executable).parent / "speculators"  # the console script of this environment


def test_upstream_public_api_imports():
    """Upstream 0.3.0's public API imports, and the generator is ours."""
    import speculators  # noqa: PLC0415 - what this test checks
    import speculators.convert  # noqa: PLC0415 - what this test checks
    import speculators.models.eagle3  # noqa: PLC0415 - what this test checks
    import speculators.train  # noqa: PLC0415 - what this test checks
    from speculators import SpeculatorModel, SpeculatorsConfig  # noqa: F401, PLC0415 - what this test checks
    from speculators.data_generation import VllmHiddenStatesGenerator  # noqa: PLC0415 - what this test checks
    from speculators.data_generation.vllm_hidden_states_generator import (  # noqa: PLC0415 - what this test checks
        VllmHiddenStatesGenerator as again,
    )

    assert VllmHiddenStatesGenerator.__module__ == "speculators_v016.generator"
    assert again is VllmHiddenStatesGenerator
    assert speculators.models.eagle3.Eagle3SpeculatorConfig.__name__ == "Eagle3SpeculatorConfig"


def test_version_names_upstream_base_and_our_revision():
    """The reported version is upstream's base release plus our revision."""
    import speculators.version  # noqa: PLC0415 - what this test checks

    assert speculators.version.version == speculators_v016.__version__
    assert speculators_v016.__version__.startswith(PIN.version + ".post")


def test_console_script_version_and_convert_help():
    """Upstream's `speculators` console script answers --version and convert --help."""
    version = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip().endswith(f"{PIN.version}.post1")
    helped = subprocess.run(
        [str(SCRIPT), "convert", "--help"], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}
    )
    assert helped.returncode == 0, helped.stderr
    assert "--algorithm" in helped.stdout and "eagle3" in helped.stdout


def test_library_stays_quiet():
    """loguru output from our package is disabled on import."""
    seen = []
    sink = logger.add(seen.append)
    try:
        exec("from loguru import logger\nlogger.warning('should not appear')", {"__name__": "speculators_v016.x"})
        exec("from loguru import logger\nlogger.warning('appears')", {"__name__": "somebody_else"})
    finally:
        logger.remove(sink)
    assert [m.record["message"] for m in seen] == ["appears"]


def test_series_check_passes():
    """`tools/patches.py check`: the series applies exactly, has headers, nothing stale."""
    proc = subprocess.run([sys.executable, "tools/patches.py", "check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok:")


@pytest.fixture
def clean_clone(tmp_path):
    clone = tmp_path / "repo"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    return clone


@pytest.fixture(scope="module")
def artifact():
    return fetch(PIN)


def build_wheel(source: Path, out: Path, env: dict) -> subprocess.CompletedProcess:
    # No build isolation: the build must work with what is already installed,
    # and PIP_NO_INDEX proves that nothing is downloaded.
    return subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        env=env,
    )


def test_offline_wheel_from_clean_clone(clean_clone, artifact, tmp_path):
    """Offline, with a local copy of the pinned artifact, a clean clone builds the right wheel."""
    env = {
        **os.environ,
        "PIP_NO_INDEX": "1",
        LOCAL_ARTIFACT_ENV: str(artifact),
        "XDG_CACHE_HOME": str(tmp_path / "empty-cache"),
    }
    proc = build_wheel(clean_clone, tmp_path / "dist", env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("speculators_v016-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "speculators/__init__.py" in names and "speculators/train/trainer.py" in names
    assert "speculators_v016/engine/core.py" in names
    assert not [n for n in names if n.startswith("tests/") or "/tests/" in n or n.endswith(".orig")]
    licences = [n for n in names if "/licenses/" in n]
    assert any(n.endswith("licenses/LICENSE") for n in licences)
    assert any(n.endswith("NOTICE") for n in licences)
    modified = next(n for n in licences if n.endswith("MODIFIED-FILES.txt"))
    text = zipfile.ZipFile(wheel).read(modified).decode()
    assert "speculators/config.py" in text and "Redirect the generator module" in text
    upstream_licence = next(n for n in licences if n.endswith("build/work/LICENSE"))
    assert b"Apache License" in zipfile.ZipFile(wheel).read(upstream_licence)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt")))
    assert b"speculators = speculators.__main__:app" in entry_points


def test_wrong_sha256_names_the_artifact(artifact, tmp_path, monkeypatch):
    """A local artifact whose sha256 differs from the pin is refused, naming it."""
    bad = tmp_path / PIN.filename
    bad.write_bytes(artifact.read_bytes() + b"tampered")
    monkeypatch.setenv(LOCAL_ARTIFACT_ENV, str(tmp_path))
    with pytest.raises(ArtifactError, match=f"upstream artifact {PIN.filename} .* has sha256"):
        fetch(PIN)


def test_offline_build_without_artifact_says_how(clean_clone, tmp_path):
    """Offline with no copy of the artifact, the build fails and says how to give one."""
    env = {**os.environ, "PIP_NO_INDEX": "1", "XDG_CACHE_HOME": str(tmp_path / "empty-cache")}
    env.pop(LOCAL_ARTIFACT_ENV, None)
    proc = build_wheel(clean_clone, tmp_path / "dist", env)
    assert proc.returncode != 0
    assert f"could not download upstream artifact {PIN.name}=={PIN.version}" in proc.stderr
    assert LOCAL_ARTIFACT_ENV in proc.stderr


def test_ci_runs_the_readme_test_command():
    """.ci/run runs exactly the README's test command."""
    readme = (ROOT / "README.md").read_text()
    command = "bash tools/setup-dev.sh && bash tools/test.sh"
    assert command in readme
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()
    runner = (ROOT / "tools" / "test.sh").read_text()
    assert '-m "not alone"' in runner and "-m alone" in runner  # every test runs, in one of the two passes
