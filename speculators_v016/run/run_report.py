"""One run of the pipeline as the terminal sees it: the summary, the verify line, the exit code.

The exit codes and their meanings are ``speculators_v016.exit_codes.ExitCode``; here a failure
is mapped to its code by kind.
"""

from __future__ import annotations

import errno

from speculators_v016.checks.self_check import SelfCheckError
from speculators_v016.config import ConfigError
from speculators_v016.exit_codes import ExitCode
from speculators_v016.layers import LayerIdError
from speculators_v016.run.dataset import BadRowError
from speculators_v016.run.pipeline import run
from speculators_v016.store.atomic_files import WriteError
from speculators_v016.store.manifest import ManifestError
from speculators_v016.store.no_links import LinkedEntryError
from speculators_v016.store.outdir import OutputDirError
from speculators_v016.store.regenerated import JournalError
from speculators_v016.store.run_config import ResumeMismatchError
from speculators_v016.store.verify import verify
from speculators_v016.target import ContextLengthError, GenerationSetupError, PromptError, RemoteCodeError


def exit_code(exc: BaseException) -> ExitCode:
    if isinstance(exc, ConfigError):  # a setting found unusable once vLLM was asked (--engine-args)
        return ExitCode.USAGE
    bad_input = (BadRowError, PromptError, LayerIdError, RemoteCodeError, ContextLengthError, GenerationSetupError)
    if isinstance(exc, bad_input):
        return ExitCode.BAD_INPUT
    if isinstance(exc, (OutputDirError, ResumeMismatchError, ManifestError, JournalError, LinkedEntryError)):
        return ExitCode.OUTPUT_REFUSED
    if isinstance(exc, WriteError) or (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)):
        return ExitCode.WRITE_FAILED
    if isinstance(exc, SelfCheckError):
        return ExitCode.SELF_CHECK_FAILED
    return ExitCode.GENERATION_FAILED


def _message(exc: BaseException, code: int, log_trouble: str | None = None, log_file=None) -> str:
    """What the terminal says: our message; the exception's type only where it is not one of ours (5). A full
    disk naming no file, while the log cannot be written, was the log's (the output of vLLM, datasets, tqdm
    goes there)."""
    if code == ExitCode.WRITE_FAILED and not isinstance(exc, WriteError) and getattr(exc, "filename", None):
        return f"error: cannot write {exc.filename}: {exc.strerror}"
    if code == ExitCode.WRITE_FAILED and not isinstance(exc, WriteError) and log_trouble:
        return (
            f"error: cannot write the log {log_file}: {getattr(exc, 'strerror', None) or exc} (the output of "
            "vLLM, torch and the dataset tools goes there); free space there, or run with -v"
        )
    if isinstance(exc, ConfigError) and exc.option:
        return f"error: {exc.option}: {exc}"
    return f"error: {exc}" if code != ExitCode.GENERATION_FAILED else f"error: {type(exc).__name__}: {exc}"


def run_and_report(opts, console, verify_after: bool = True) -> int:
    """Run the pipeline under ``console``: progress, summary and verify line, or the error and the log."""
    try:
        summary = run(opts, progress_to=console.err if console.progress and opts.progress else None)
    except KeyboardInterrupt:
        console.echo("interrupted: finished samples are kept; run the same command again to resume", err=True)
        console.where()
        return ExitCode.INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every failure gets a message and an exit code
        code = exit_code(exc)
        trouble = console.log_trouble() if code == ExitCode.WRITE_FAILED else None
        console.failure(_message(exc, code, trouble, console.log_file))
        console.log_exception(exc)  # the log (or, with --verbose, the terminal)
        return code
    for line in summary.lines():
        console.echo(line, summary=True)
    code = ExitCode.OK if summary.logit_check.get("ok", True) else ExitCode.PROBLEMS_FOUND
    if verify_after:
        try:
            report = verify(summary.output_dir, partial=opts.num_shards > 1, deep=opts.deep_verify)
        except Exception as exc:  # noqa: BLE001 - verify reports findings; this is a bug of ours, said so
            console.log_exception(exc)
            console.failure(f"verify:     could not run ({type(exc).__name__}: {exc})")
            return ExitCode.PROBLEMS_FOUND
        kind = "" if opts.deep_verify else "; names, sizes, completeness: `verify DIR` reads every file"
        console.echo(f"verify:     {'ok' if report.ok else 'FAILED'} ({report.samples} samples{kind})", summary=True)
        for problem in report.problems[:20]:
            console.echo(f"  {problem}", err=True)
        code = code if report.ok else ExitCode.PROBLEMS_FOUND
    console.where()
    return code
