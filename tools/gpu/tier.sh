#!/usr/bin/env bash
# The GPU tier on a lent GPU machine, through ../shared/gpu-vllm (vLLM 0.16's own GPU code), in one command:
#   . .gpu-vllm/install.sh && bash tools/gpu/tier.sh [PYTEST ARGS ...]   (default: tests/gpu)
# .gpu-vllm built by tools/gpu/build_kit.sh (the shared kit plus compressed-tensors, which the INT4 tier needs).
# One test process at a time: vLLM sizes its KV cache from the GPU's free memory, and engines of other
# processes starting or stopping beside it fail its memory profiling ("Error in memory profiling") or leave
# it no room. The run stops at GPU_TIER_LIMIT seconds (default 540) so that its log always comes back.
# Logs, the figures (SPECULATORS_GPU_FIGURES) and the architecture results go to $OUT (or ./gpu-out): the log
# as it is, the rest as one tarball (the device tool brings back at most 8 files).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export SPECULATORS_GPU_FIGURES=$out/figures
[ $# -gt 0 ] || set -- tests/gpu
timeout "${GPU_TIER_LIMIT:-540}" python3 -m pytest -q -s -rfEs -p no:cacheprovider "$@" > "$out/tier.log" 2>&1
status=$?
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$out/tier.log" | tail -n 40
members=()  # what exists of the two: tar stops at a folder it cannot enter (a subset of the tier may make neither)
[ -d "$out/figures" ] && members+=(-C "$out" figures)
[ -d build/test-results ] && members+=(-C "$PWD/build" test-results)
[ ${#members[@]} -eq 0 ] || tar czf "$out/results.tgz" "${members[@]}"
rm -rf "$out/figures"
exit $status
