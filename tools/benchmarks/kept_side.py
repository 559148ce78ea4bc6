"""A measured process kept running between passes (no torch here: a benchmark's parent imports it)."""

from __future__ import annotations

import json
import subprocess
import sys


class Side:
    """A measured process kept running between passes: ``script`` started with ``args`` (JSON) and ``env``; it
    prints one JSON line when ready, then one per line it is asked (``ask``), until its stdin closes. Two sides'
    passes asked one after the other run seconds apart, where fresh processes (``common.child``) run an engine
    start apart: on a shared machine whose other tenants come and go, the closer two passes run, the less a ratio
    of them moves."""

    def __init__(self, script: str, args: dict, env: dict | None = None):
        self.name = args.get("side") or args.get("mode")
        self.proc = subprocess.Popen([sys.executable, script, json.dumps(args)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
        self.ready = self._reply()

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"side {self.name} ended (exit {self.proc.wait()})")

    def ask(self, what: str = "run") -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        """Close its stdin (it shuts its engine down and exits); killed if it has not within 120 s."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
