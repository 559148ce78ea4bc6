"""Helpers of the CLI and fault tests: data files, running the real command, reading results."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from speculators_v016.demo import corpus_lines
from speculators_v016.manifest import Manifest
from speculators_v016.sample_format import load_sample

CPU = {"SPECULATORS_DATA_GEN_DTYPE": "float32", "SPECULATORS_DATA_GEN_ENFORCE_EAGER": "1",
       "SPECULATORS_DATA_GEN_NO_PROGRESS": "1", "SPECULATORS_DATA_GEN_NUM_PREPROCESSING_WORKERS": "1"}


def conversations(count: int, seed: int = 0) -> list[dict]:
    """Synthetic chats from the demo corpus, in both row shapes."""
    rng, lines = random.Random(seed), corpus_lines()
    rows = []
    for i in range(count):
        turns = [(("human", "user"), rng.choice(lines)), (("gpt", "assistant"), " ".join(rng.sample(lines, 2)))]
        if i % 2:
            rows.append({"messages": [{"role": r[1], "content": t} for r, t in turns]})
        else:
            rows.append({"conversations": [{"from": r[0], "value": t} for r, t in turns]})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Result:
    def __init__(self, proc: subprocess.CompletedProcess):
        self.exit_code, self.output = proc.returncode, proc.stdout + proc.stderr


def invoke(*args, env=None) -> Result:
    """Run the real command in a fresh process, as a user would."""
    cmd = [sys.executable, "-m", "speculators_v016.cli", *map(str, args)]
    return Result(subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **CPU, **(env or {})},
                                 timeout=600))


def load_all(folder: Path) -> dict[int, dict]:
    return {i: load_sample(folder / e.file) for i, e in Manifest(folder).entries().items()}


