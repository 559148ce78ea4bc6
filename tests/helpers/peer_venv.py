"""Upstream speculators 0.9.0's released data path in a venv of its own: the peer of tests/cli/test_serve.py.

A real ``pip install`` of the released packages into ``build/peer-venvs/speculators-0.9.0`` (kept between
local runs; a stamp file says what it holds). tools/test.sh starts ``python tests/helpers/peer_venv.py`` in
the background before the tests, so the install (a minute or more of one core) runs beside the serial
``alone`` round instead of inside a test; the test's fixture calls ``ensure()``, which waits for that build
(a file lock), and builds the venv itself where none is ready. Only the standard library here: the script
runs before any test, with whatever interpreter tools/test.sh has.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

PEER = ("speculators==0.9.0", "hs-connectors==0.9.0", "torch==2.13.0")  # torch: the CPU build this machine kind has
VENV = Path(__file__).resolve().parents[2] / "build" / "peer-venvs" / "speculators-0.9.0"
# The peer's environment: none of our interpreter's paths.
ENV = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}, "HF_HUB_OFFLINE": "1"}
# What tests/helpers/peer_client_090.py imports: the build's last step imports them once.
IMPORTS = (
    "import openai, datasets, hs_connectors, safetensors.torch, speculators.data_generation.offline, "
    "speculators.data_generation.vllm_client, speculators.train.data"
)


def ensure() -> Path:
    """The peer venv's python, built first unless a finished build of ``PEER`` is there (waits for one under way)."""
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / f"{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = VENV / ".installed"
        if not stamp.exists() or stamp.read_text() != " ".join(PEER):
            _build()
            stamp.write_text(" ".join(PEER))
    return VENV / "bin" / "python"


def _build() -> None:
    """venv, pip install of PEER, then its imports once (a broken install fails here, not in the test)."""
    python = VENV / "bin" / "python"
    subprocess.run([sys.executable, "-m", "venv", "--clear", VENV], check=True)
    # --no-compile: pip's bytecode pass over all of torch is half the install; the imports below compile
    # (and write, where the environment lets Python write bytecode) just what the peer client runs
    pip = [python, "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    subprocess.run([*pip, *PEER], check=True, timeout=1800)
    # its torchvision and torchaudio from the index do not load beside that torch, and it imports neither
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio"], check=True)
    env = {k: v for k, v in ENV.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([python, "-c", IMPORTS], check=True, timeout=600, env=env, cwd=VENV)


if __name__ == "__main__":
    print(ensure())
