"""One run of the pipeline as the terminal sees it: the summary, the verify line, the exit code."""

from __future__ import annotations

import sys
import traceback


def exit_code(exc: BaseException) -> int:
    from speculators_v016.run.dataset import BadRowError
    from speculators_v016.target import PromptError, RemoteCodeError
    from speculators_v016.layers import LayerIdError
    from speculators_v016.store.outdir import OutputDirError
    from speculators_v016.store.run_config import ResumeMismatchError
    from speculators_v016.store.atomic_files import WriteError

    if isinstance(exc, (BadRowError, PromptError, LayerIdError, RemoteCodeError)):
        return 3
    if isinstance(exc, (OutputDirError, ResumeMismatchError)):
        return 4
    if isinstance(exc, WriteError):
        return 6
    return 5


def run_and_report(opts, console, verify_after: bool = True) -> int:
    """Run the pipeline under ``console``: progress, summary and verify line, or the error and the log."""
    from speculators_v016.run.pipeline import run
    from speculators_v016.store.verify import verify

    try:
        summary = run(opts, progress_to=console.err if console.progress and opts.progress else None)
    except KeyboardInterrupt:
        console.echo("interrupted: finished samples are kept; run the same command again to resume", err=True)
        console.where()
        return 130
    except Exception as exc:  # noqa: BLE001 - every failure gets a message and an exit code
        code = exit_code(exc)
        console.failure(f"error: {exc}" if code != 5 else f"error: {type(exc).__name__}: {exc}")
        traceback.print_exception(exc, file=sys.stderr)  # the log (or, with --verbose, the terminal)
        return code
    for line in summary.lines():
        console.echo(line, summary=True)
    code = 0 if summary.logit_check.get("ok", True) else 1
    if verify_after:
        report = verify(summary.output_dir, partial=opts.num_shards > 1, deep=opts.deep_verify)
        kind = "" if opts.deep_verify else "; names, sizes, completeness: `verify DIR` reads every file"
        console.echo(f"verify:     {'ok' if report.ok else 'FAILED'} ({report.samples} samples{kind})", summary=True)
        for problem in report.problems[:20]:
            console.echo(f"  {problem}", err=True)
        code = code if report.ok else 1
    console.where()
    return code
