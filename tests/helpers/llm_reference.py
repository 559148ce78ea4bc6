"""vLLM's own ``LLM.generate`` as a test's reference, run through ``llm_generate.py`` in a process of its own."""

import json
import subprocess
import sys
from pathlib import Path

from speculators_v016.engine.core import START_ATTEMPTS, says_port_taken

SCRIPT = Path(__file__).with_name("llm_generate.py")


def root_cause(stderr: str, limit: int = 6000) -> str:
    """The first traceback in ``stderr`` (a worker's, under the multiprocess executor) and the output's end."""
    first = stderr.find("Traceback")
    head = stderr[first : first + limit // 2] if first >= 0 else ""
    return f"first traceback:\n{head}\n...\nend of the output:\n{stderr[-limit // 2 :]}"


def llm_generate(args: dict, where: Path) -> list[list[int]]:
    """The tokens ``LLM.generate`` samples for ``args`` (model, prompts, engine, sampling: see llm_generate.py)."""
    (where / "args.json").write_text(json.dumps(args))
    # started again only where vLLM's rendezvous port was taken under it, as the generator does (engine/core.py);
    # under the multiprocess executor the cause is printed by a worker only, so it is read from the output
    for attempt in range(1, START_ATTEMPTS + 1):
        proc = subprocess.run([sys.executable, SCRIPT, where / "args.json", where / "out.json"], capture_output=True,
                              text=True, timeout=600)  # fmt: skip
        if proc.returncode == 0:
            return json.loads((where / "out.json").read_text())
        if attempt == START_ATTEMPTS or not says_port_taken(proc.stderr):
            raise AssertionError(f"LLM.generate failed (attempt {attempt}):\n{root_cause(proc.stderr)}")
    raise AssertionError("unreachable")
