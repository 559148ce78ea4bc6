#!/usr/bin/env bash
# Build .gpu-vllm (../shared/gpu-vllm/build.sh: vLLM 0.16's GPU code, its dependencies, this project's wheel),
# then add the wheels the GPU tier needs beyond it: compressed-tensors, for the INT4 experts in Kimi-K2.5's
# format (tests/gpu/test_int4_moe_gpu.py; without it vLLM cannot load them: "No module named
# 'compressed_tensors'"), at the version of this venv. .gpu-vllm/install.sh installs every wheel under w/.
#   bash tools/gpu/build_kit.sh     # then carry .gpu-vllm: . .gpu-vllm/install.sh && bash tools/gpu/tier.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
bash ../shared/gpu-vllm/build.sh
version=$("$py" -c "import compressed_tensors; print(compressed_tensors.__version__)")
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .gpu-vllm/w \
  "compressed-tensors==$version"
ls .gpu-vllm/w | grep -i compressed
