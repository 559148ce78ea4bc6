#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run). Most of a CLI or engine test
# is one process starting vLLM, so two pytest workers (pytest-xdist, whole
# files per worker: a module's engine is started once) use CI's two cores.
# Tests marked `alone` look at the whole /dev/shm (what a killed run left,
# what a cleaner may delete), so they run by themselves, with no other test
# beside them: first, while the peer venv of tests/cli/test_serve.py (upstream
# 0.9.0's released client, tests/helpers/peer_venv.py) is pip-installed in the
# background on the core their one process leaves idle (pip makes nothing in
# /dev/shm; the test waits for that build, or makes the venv itself).
# ruff (lint and format, pyproject.toml) runs first: a seconds-long gate.
# Extra arguments go to every pytest run. Each round lists its 25 slowest tests (CI keeps under 50 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
workers=${TEST_WORKERS:-2}
"$py" -m ruff check --quiet .
"$py" -m ruff format --check --quiet .
# pytest imports test files by basename (no packages under tests/): two files of one name stop collection.
dupes=$(find tests -name 'test_*.py' -printf '%f\n' | sort | uniq -d)
[ -z "$dupes" ] || { echo "test files share a name: $dupes" >&2; exit 1; }
mkdir -p build
"$py" tests/helpers/peer_venv.py > build/peer-venv.log 2>&1 &
peer=$!
trap 'wait "$peer" || true' EXIT  # never a half-made venv left behind by a failed round
"$py" -m pytest -q --durations=25 -m alone "$@" tests || [ $? -eq 5 ]  # 5: arguments that select none of them
# Two rounds of workers, the real command's tests and then the in-process ones, so whatever an engine leaves
# behind in a worker ends with its round. Before engine shutdown let go of the forward context, vLLM 0.16's
# CPU MoE layer (which outlives its engine) kept a KV cache per MoE engine: workers reached 11-14 GiB and
# the kernel's OOM killer took one on a 24 GiB machine. Now they peak at 2-4 GiB; the rounds stay a guard.
"$py" -m pytest -q --durations=25 -n "$workers" --dist loadfile -m "not alone" "$@" tests/cli
"$py" -m pytest -q --durations=25 -n "$workers" --dist loadfile --no-loadscope-reorder -m "not alone" "$@" \
  tests/engine tests/unit tests/distribution tests/gpu  # the longest files first: tests/conftest.py LONGEST_FIRST
