"""verify, the real command, on a folder with samples its user cannot read: every one named, the rest checked.

(Moved from tests/unit/test_verify_findings.py: it runs the command in a fresh process, and as root drops to
another user in a user namespace.)"""

import os
import subprocess
import sys

import pytest

from helpers.folders import make_folder


def test_every_unreadable_sample_is_reported(tmp_path):
    """Two samples the user cannot read: `verify` names both and checks the rest (it stopped at the first)."""
    out = make_folder(tmp_path / "out", count=6)
    for i in (1, 4):
        (out / f"data_{i}.safetensors").chmod(0)
    prefix = ["unshare", "--user", "--map-user=1000", "--map-group=1000"] if os.geteuid() == 0 else []
    if prefix and subprocess.run([*prefix, "true"], capture_output=True).returncode != 0:
        pytest.skip("running as root, and no user namespace to drop it")
    cmd = [*prefix, sys.executable, "-m", "speculators_v016.run.cli", "-q", "verify", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    for i in (1, 4):
        assert f"FAIL {out}/data_{i}.safetensors: cannot be read (Permission denied)" in output, output
    assert "cannot be verified" not in output
    assert "FAILED: 4 samples" in output, output  # the four readable ones were all checked
