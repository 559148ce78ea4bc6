"""vLLM's own ``LLM.generate`` as a test's reference, run through ``llm_generate.py`` in a process of its own."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("llm_generate.py")

#: Starts tried when vLLM's rendezvous port was taken under it (the generator itself retries the same way:
#: speculators_v016.engine.core.START_ATTEMPTS). Other failures are never retried.
ATTEMPTS = 3


def port_taken(stderr: str) -> bool:
    """Did the reference's engine die because another process took the port vLLM picked (torch's store: EADDRINUSE)?
    Under the multiprocess executor the cause is printed by a worker only, so it is read from the output."""
    return "EADDRINUSE" in stderr or "address already in use" in stderr.lower()


def root_cause(stderr: str, limit: int = 6000) -> str:
    """The first traceback in ``stderr`` (a worker's, under the multiprocess executor) and the output's end."""
    first = stderr.find("Traceback")
    head = stderr[first : first + limit // 2] if first >= 0 else ""
    return f"first traceback:\n{head}\n...\nend of the output:\n{stderr[-limit // 2 :]}"


def llm_generate(args: dict, where: Path) -> list[list[int]]:
    """The tokens ``LLM.generate`` samples for ``args`` (model, prompts, engine, sampling: see llm_generate.py)."""
    (where / "args.json").write_text(json.dumps(args))
    for attempt in range(1, ATTEMPTS + 1):
        proc = subprocess.run([sys.executable, SCRIPT, where / "args.json", where / "out.json"], capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        if proc.returncode == 0:
            return json.loads((where / "out.json").read_text())
        if attempt == ATTEMPTS or not port_taken(proc.stderr):
            raise AssertionError(f"LLM.generate failed (attempt {attempt}):\n{root_cause(proc.stderr)}")
    raise AssertionError("unreachable")
