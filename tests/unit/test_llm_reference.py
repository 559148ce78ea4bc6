"""The tests' vLLM reference process: started again only where its rendezvous port was taken, its cause shown."""

import pytest

from helpers import llm_reference
from speculators_v016.engine.core import START_ATTEMPTS

# A stand-in for llm_generate.py: counts its runs, fails the first ``fail`` of them with ``error``, then writes tokens.
STAND_IN = """
import json, sys
from pathlib import Path
runs = Path(sys.argv[1]).with_name("runs")
n = int(runs.read_text()) if runs.exists() else 0
runs.write_text(str(n + 1))
args = json.loads(Path(sys.argv[1]).read_text())
if n < args["fail"]:
    sys.stderr.write("Traceback (most recent call last):\\n" + args["error"] + "\\n" + "noise\\n" * 2000)
    sys.exit(1)
Path(sys.argv[2]).write_text(json.dumps([[7, 8]]))
"""
PORT_TAKEN = (
    "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
    "port: 41234, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(llm_reference, "SCRIPT", script)
    return tmp_path


def test_a_taken_port_starts_the_reference_again(stand_in):
    """Torch's EADDRINUSE in the output: the reference runs again and its tokens come back."""
    assert llm_reference.llm_generate({"fail": 1, "error": PORT_TAKEN}, stand_in) == [[7, 8]]
    assert (stand_in / "runs").read_text() == "2"


def test_any_other_failure_is_not_retried_and_shows_its_first_traceback(stand_in):
    """Another failure: one run, and the error shows the first traceback even under long output after it."""
    with pytest.raises(AssertionError, match=r"attempt 1\):\nfirst traceback:\nTraceback .*\nOSError: no config"):
        llm_reference.llm_generate({"fail": 1, "error": "OSError: no config"}, stand_in)
    assert (stand_in / "runs").read_text() == "1"


def test_a_port_taken_every_time_gives_up_after_the_attempts(stand_in):
    """The port taken on every start: the generator's number of attempts, then the failure with its cause."""
    with pytest.raises(AssertionError, match=rf"(?s)attempt {START_ATTEMPTS}\):\nfirst traceback:.*EADDRINUSE"):
        llm_reference.llm_generate({"fail": 99, "error": PORT_TAKEN}, stand_in)
    assert (stand_in / "runs").read_text() == str(START_ATTEMPTS)
