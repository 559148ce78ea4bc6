#!/usr/bin/env bash
# A GPU job longer than one call of the device tool (10 minutes at most a call): start it in the background,
# then poll it from later calls, each made within the machine's idle release (30 s) of the one before, and each
# carrying what the first carried (.gpu-vllm): every call lays the working tree down again (2026-12-05: a poll
# without it, and from then on every new process failed to import the kit's xgrammar stub, under .gpu-vllm/stubs).
#   bash tools/gpu/background.sh start COMMAND...   # on the lent machine, in the repository root
#   bash tools/gpu/background.sh poll [SECONDS]     # waits up to SECONDS (default 540) for the job to end
# The job runs in a copy of the tree taken at start ($GPU_BG/tree): each later call of the device tool lays the
# working tree down again, and on 2026-12-06 a poll did so while the job's CLI was starting, whose import then
# failed (No module named 'speculators_v016.worker.capture'); PYTHONPATH's entries in the tree (the kit's stubs)
# are pointed at the copy too. The job's pages go to the copy's docs/benchmarks.
# The job runs under setsid with its output in $GPU_BG/log (default /tmp/gpu-bg) and its exit status in
# $GPU_BG/rc once it ends; it may write results under $GPU_BG/out. Each poll prints the log's tail and, once
# the job has ended, packs $GPU_BG (less the copy) and the copy's docs/benchmarks (the pages a benchmark wrote, their history kept) into
# $OUT/gpu-bg.tgz (the device tool brings $OUT back) and exits with the job's status; while it still runs,
# poll copies the log so far to $OUT/gpu-bg.log, the files directly under $GPU_BG/out to $OUT, and exits 75 (EX_TEMPFAIL): call poll again.
set -uo pipefail
bg=${GPU_BG:-/tmp/gpu-bg}
case "${1:-}" in
start)
    shift
    [ $# -gt 0 ] || { echo "usage: $0 start COMMAND..." >&2; exit 2; }
    if [ -e "$bg/pid" ] && [ ! -e "$bg/rc" ]; then
        echo "a job is running already ($bg/pid): poll it" >&2
        exit 2
    fi
    case "$(realpath -m "$bg")/" in "$PWD"/*) echo "$bg lies in the tree it would copy: set GPU_BG elsewhere" >&2; exit 2;; esac
    rm -rf "$bg" && mkdir -p "$bg/out" && cp -a . "$bg/tree" || { echo "could not copy the tree to $bg/tree" >&2; exit 2; }
    printf '%q ' "$@" > "$bg/command"
    [ -n "${PYTHONPATH:-}" ] && export PYTHONPATH="${PYTHONPATH//$PWD/$bg/tree}"
    setsid nohup bash -c 'cd "$0/tree" && "$@" > "$0/log" 2>&1; echo $? > "$0/rc"' "$bg" "$@" < /dev/null > /dev/null 2>&1 &
    echo $! > "$bg/pid"
    echo "started: $(cat "$bg/command")(pid $(cat "$bg/pid"), in $bg/tree, log $bg/log)"
    ;;
poll)
    limit=${2:-540}
    [ -e "$bg/pid" ] || { echo "no job was started here ($bg): the machine may be a fresh one" >&2; exit 2; }
    for _ in $(seq "$limit"); do
        [ -e "$bg/rc" ] && break
        sleep 1
    done
    tail -n 40 "$bg/log"
    if [ ! -e "$bg/rc" ]; then
        mkdir -p "${OUT:-gpu-out}" && cp "$bg/log" "${OUT:-gpu-out}/gpu-bg.log"  # so far, should the machine go:
        find "$bg/out" -maxdepth 1 -type f -exec cp {} "${OUT:-gpu-out}/" \;  # and what the job finished so far
        echo "still running after ${limit} s: poll again"
        exit 75
    fi
    mkdir -p "${OUT:-gpu-out}"
    tar czf "${OUT:-gpu-out}/gpu-bg.tgz" --exclude="$(basename "$bg")/tree" -C "$(dirname "$bg")" "$(basename "$bg")" \
        -C "$bg/tree" docs/benchmarks
    echo "ended with status $(cat "$bg/rc"); results in ${OUT:-gpu-out}/gpu-bg.tgz"
    exit "$(cat "$bg/rc")"
    ;;
*)
    echo "usage: $0 start COMMAND... | poll [SECONDS]" >&2
    exit 2
    ;;
esac
