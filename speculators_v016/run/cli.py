"""``speculators-data-gen``: a dataset in, verified EAGLE-3 training files out.

Accepts the options of upstream speculators 0.3.0's
``scripts/data_generation_offline.py`` with the same names and meanings, so
launch scripts switch by changing the command name; adds resumable, sharded,
atomic output and the ``verify``, ``check``, ``demo`` and ``clean-shm`` subcommands.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
from pathlib import Path

import click

from speculators_v016.config import (
    CHECK_OPTIONS,
    CLEAN_SHM_OPTIONS,
    DEMO_OPTIONS,
    ENV_PREFIX,
    MAIN_OPTIONS,
    SECTIONS,
    SERVE_OPTIONS,
    TERMINAL,
    VERIFY_OPTIONS,
    CheckConfig,
    CleanShmConfig,
    ConfigError,
    ConsoleConfig,
    DemoConfig,
    EngineConfig,
    RunConfig,
    ServeConfig,
    VerifyConfig,
    env_name,
    option_fields,
    parse_layer_ids,
)
from speculators_v016.exit_codes import ExitCode, help_text
from speculators_v016.run import huge_pages
from speculators_v016.shared import exit_gc

EXIT_CODES = f"""\b
{help_text()}
Every option can also be set from the environment: --some-option as
SPECULATORS_DATA_GEN_SOME_OPTION (e.g. SPECULATORS_DATA_GEN_OUTPUT_DIR), a
subcommand's as SPECULATORS_DATA_GEN_<SUBCOMMAND>_SOME_OPTION (e.g.
SPECULATORS_DATA_GEN_VERIFY_PARTIAL). An unknown SPECULATORS_DATA_GEN_*
variable is a usage error."""


def usage_error(exc: ConfigError) -> click.ClickException:
    """A configuration error as click reports it: naming the option to blame, if one."""
    return click.BadParameter(str(exc), param_hint=exc.option) if exc.option else click.UsageError(str(exc))


class LayerIds(click.ParamType):
    """``--layer-ids``' value: ids, space- or comma-separated (upstream's nargs form is joined by :func:`main`)."""

    name = "ids"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return parse_layer_ids(value)
        except ConfigError as exc:
            raise usage_error(exc) from None


class JsonObject(click.ParamType):
    """A JSON object's text (``--engine-args``), as a dict; anything else is a usage error naming the option."""

    name = "json"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(f'{value!r} is not JSON ({exc}); give an object, e.g. \'{{"kv_cache_dtype": "fp8"}}\'')
        if not isinstance(parsed, dict):
            self.fail(f"{value!r} is a JSON {type(parsed).__name__}; give an object of vLLM EngineArgs fields")
        return parsed


class ConfigOption(click.Option):
    """An option with a help section; with ``keep_empty``, its variable set to "" is a value (not "unset")."""

    def __init__(self, *args, section: str | None = None, keep_empty: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.section, self.keep_empty = section, keep_empty

    def resolve_envvar_value(self, ctx):
        if self.keep_empty and isinstance(self.envvar, str) and os.environ.get(self.envvar) == "":
            return ""  # --layer-ids "" is a usage error; so is its variable set to ""
        return super().resolve_envvar_value(ctx)


def _click_type(f):
    """The click type of config field ``f``: its choices, bounds, or kind."""
    meta = f.meta
    if meta["kind"] == "layer_ids":
        return LayerIds()
    if meta["kind"] == "json_object":
        return JsonObject()
    if meta["kind"] == "dir":
        return click.Path(file_okay=False, path_type=Path)
    if f.choices is not None:
        return click.Choice(f.choices, case_sensitive=meta["case_sensitive"])
    ranged = meta["min"] is not None or meta["max"] is not None
    if f.base is int:
        return click.IntRange(meta["min"], meta["max"], min_open=meta["min_open"]) if ranged else click.INT
    if f.base is float:
        return click.FloatRange(meta["min"], meta["max"], min_open=meta["min_open"]) if ranged else click.FLOAT
    return click.STRING


def config_option(f):
    """The click option decorator of config field ``f`` (see :func:`speculators_v016.config.setting`)."""
    decls = [f.flag] + ([f.meta["short"]] if f.meta["short"] else []) + [f.param]
    if f.base is bool:
        return click.option(
            *decls,
            cls=ConfigOption,
            is_flag=True,
            help=f.meta["help"],
            hidden=f.meta["hidden"],
            section=f.meta["section"],
        )
    return click.option(
        *decls,
        cls=ConfigOption,
        type=_click_type(f),
        default=f.cli_default,
        required=f.meta["required"],
        multiple=f.base is tuple and f.meta["kind"] is None,
        help=f.meta["help"],
        hidden=f.meta["hidden"],
        section=f.meta["section"],
        keep_empty=f.meta["kind"] == "layer_ids",
    )


def config_options(spec: tuple = MAIN_OPTIONS):
    """Decorate a command with an option per field of ``spec`` (see speculators_v016.config.MAIN_OPTIONS)."""

    def decorate(command):
        for f in reversed(option_fields(spec)):
            command = config_option(f)(command)
        return command

    return decorate


def _values_of(cls, values: dict, spec: tuple = MAIN_OPTIONS) -> dict:
    """The fields of ``cls`` among a command's ``values`` (by option), negated flags turned back, multiple
    values as a tuple."""
    out = {}
    for f in option_fields(spec):
        if f.owner is cls:
            value = values[f.param]
            out[f.name] = not value if f.meta["negate"] else tuple(value) if isinstance(value, list) else value
    return out


def command_config(cls, values: dict, spec: tuple, **arguments):
    """A subcommand's config (``cls``) from its option values (and its ``arguments``), or a usage error."""
    try:
        return cls(**_values_of(cls, values, spec), **arguments)
    except ConfigError as exc:
        raise usage_error(exc) from None


def run_config(values: dict) -> RunConfig:
    """The run's config from the main command's option values: whole, or a usage error."""
    engine = _values_of(EngineConfig, values)
    run = _values_of(RunConfig, values)
    try:
        return RunConfig.build(engine, **run)
    except ConfigError as exc:
        raise usage_error(exc) from None


def known_variables(group: click.Group) -> dict[str, str]:
    """Every option's environment variable, of the command and its subcommands, with what it sets."""
    out = {}
    for name, command in [(None, group), *group.commands.items()]:
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.envvar, str):
                out[param.envvar] = f"{name} {param.opts[-1]}" if name else max(param.opts, key=len)
    return out


def name_variables(group: click.Group) -> None:
    """Give every option of ``group`` and its subcommands the variable the rule names (see EXIT_CODES)."""
    for name, command in [(None, group), *group.commands.items()]:
        for param in command.params:
            if not isinstance(param, click.Option):
                continue
            flags = [o for o in param.opts if o.startswith("--")]
            settable = param.name not in ("help", "version") and flags
            param.envvar = env_name(max(flags, key=len), name) if settable else None
            param.allow_from_autoenv = False


def _format_sections(command: click.Command, ctx, formatter) -> None:
    """``command``'s options under their help sections (speculators_v016.config.SECTIONS)."""
    sections: dict[str, list] = {}
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is not None:
            sections.setdefault(getattr(param, "section", None) or TERMINAL, []).append(record)
    for section in SECTIONS:
        if sections.get(section):
            with formatter.section(f"{section} options"):
                formatter.write_dl(sections[section])


class SectionedCommand(click.Command):
    """A subcommand whose options are listed in help sections."""

    def format_options(self, ctx, formatter):
        _format_sections(self, ctx, formatter)


class MainGroup(click.Group):
    """The command group: options in help sections, and no unknown SPECULATORS_DATA_GEN_* variable."""

    def format_options(self, ctx, formatter):
        _format_sections(self, ctx, formatter)
        self.format_commands(ctx, formatter)

    def invoke(self, ctx):
        self.refuse_unknown_variables(os.environ)
        return super().invoke(ctx)

    def refuse_unknown_variables(self, environ) -> None:
        """A SPECULATORS_DATA_GEN_* variable no option reads is a usage error naming the nearest known one:
        a typo silently ignored would be a run with settings nobody asked for."""
        known = known_variables(self)
        prefix = ENV_PREFIX + "_"
        unknown = sorted(n for n in environ if n.startswith(prefix) and n not in known)
        if not unknown:
            return
        lines = []
        for name in unknown:
            near = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
            hint = f" (nearest: {near[0]}, for {known[near[0]]})" if near else ""
            lines.append(f"{name}{hint}")
        raise click.UsageError(
            "unknown environment variable"
            + ("s " if len(lines) > 1 else " ")
            + "; ".join(lines)
            + ": no option reads it; fix its name, or unset it"
        )


@click.group(
    cls=MainGroup,
    invoke_without_command=True,
    epilog=EXIT_CODES,
    context_settings={
        "show_default": True,
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
    },
)
@config_options(MAIN_OPTIONS)
@click.version_option(package_name="speculators-v016", message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx, **values):
    """Generate EAGLE-3 training data: hidden states of a target model, one file per sample.

    \b
    speculators-data-gen --target-model-path M --train-data-path data.jsonl --output-dir out/
    speculators-data-gen verify out/          # every file intact and complete?
    speculators-data-gen check --target-model-path M --train-data-path data.jsonl
    speculators-data-gen demo                 # the whole pipeline on a tiny local model
    speculators-data-gen clean-shm            # shared memory that killed runs left

    Layer ids mean what upstream speculators means: id L is the output of decoder
    layer L before the final norm. A draft trained on the data must be served by
    vLLM with eagle_aux_hidden_state_layer_ids = [L+1 for all but the last id];
    data_config.json records both.
    """
    terminal = command_config(ConsoleConfig, values, MAIN_OPTIONS)
    ctx.obj = {"mode": terminal.mode, "log_level": terminal.log_level}
    if ctx.invoked_subcommand is not None:
        return
    missing = [
        name
        for name, key in (
            ("--target-model-path", "target_model_path"),
            ("--train-data-path", "train_data_path"),
            ("--output-dir", "output_dir"),
        )
        if not values[key]
    ]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (or a subcommand: verify, check, demo, clean-shm)")
    config = run_config(values)
    from speculators_v016.run.console import Console, run_log_path  # noqa: PLC0415 - imports torch; --help must not
    from speculators_v016.store.outdir import shard_name  # noqa: PLC0415 - imports torch; --help must not

    shards = config.num_shards
    suffix = f"-{shard_name(config.shard_index, shards)}" if shards > 1 else ""
    with Console(run_log_path(config.output_dir, "run", suffix), ctx.obj["mode"], terminal.log_level) as console:
        # the run's heavy imports under the console: what they print goes to the log
        from speculators_v016.run.run_report import run_and_report  # noqa: PLC0415 - torch, transformers; off --help

        code = run_and_report(config, console)
    ctx.exit(code)


@cli.command()
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
@config_options(VERIFY_OPTIONS)
@click.pass_obj
def verify(obj, directory, **values):
    """Check DIRECTORY (and its shard-* folders): every sample present once, intact, as configured."""
    config = command_config(VerifyConfig, values, VERIFY_OPTIONS, directory=directory)
    from speculators_v016.run.console import Console, scratch_log_path  # noqa: PLC0415 - imports torch; --help must not
    from speculators_v016.store.verify import verify as run_verify  # noqa: PLC0415 - imports torch; --help must not

    with Console(scratch_log_path("verify"), obj["mode"], obj["log_level"]) as console:
        try:
            report = run_verify(config.directory, partial=config.partial)
        except Exception as exc:  # noqa: BLE001 - verify reports findings; anything else is a bug of ours, said so
            console.failure(f"FAIL {config.directory}: verify could not run ({type(exc).__name__}: {exc})")
            console.log_exception(exc)
            sys.exit(ExitCode.PROBLEMS_FOUND)
        for problem in report.problems:
            console.echo(f"FAIL {problem}", summary=True)
        for note in report.notes:
            console.echo(f"note {note}")
        status = "ok" if report.ok else "FAILED"
        console.echo(
            f"{status}: {report.samples} samples, {report.tokens} tokens in {len(report.folders)} "
            f"folder(s), {len(report.problems)} problem(s)",
            summary=True,
        )
    sys.exit(ExitCode.OK if report.ok else ExitCode.PROBLEMS_FOUND)


@cli.command(cls=SectionedCommand)
@config_options(CHECK_OPTIONS)
@click.pass_obj
def check(obj, **values):
    """Check captured states: vLLM's logits, each layer replayed in transformers, the whole model if it fits."""
    from speculators_v016.run.console import Console, scratch_log_path  # noqa: PLC0415 - imports torch; --help must not

    try:
        config = CheckConfig.build(
            _values_of(EngineConfig, values, CHECK_OPTIONS), **_values_of(CheckConfig, values, CHECK_OPTIONS)
        )
    except ConfigError as exc:
        raise usage_error(exc) from None
    with Console(scratch_log_path("check"), obj["mode"], obj["log_level"]) as console:
        from speculators_v016.run.run_report import exit_code  # noqa: PLC0415 - torch, transformers; off --help

        try:
            from speculators_v016.run.check import check as run_check  # noqa: PLC0415 - torch, transformers; off --help

            report = run_check(config)
        except Exception as exc:  # noqa: BLE001 - explained, logged, exit code by kind
            console.failure(f"error: {type(exc).__name__}: {exc}")
            sys.exit(exit_code(exc))
        for line in report.lines():
            console.echo(line, summary=True)
        console.where()
    sys.exit(ExitCode.OK if report.ok else ExitCode.PROBLEMS_FOUND)


@cli.command(cls=SectionedCommand)
@config_options(SERVE_OPTIONS)
@click.pass_obj
def serve(obj, **values):
    """Serve hidden states online: clients ask for samples, each one's states are published to --serve-dir.

    \b
    speculators-data-gen serve --target-model-path M --serve-dir /dev/shm/states [--train-data-path data.jsonl]

    A trainer reads them with speculators_v016.online.OnlineSampleDataset
    (docs/online.md). Runs until SIGTERM or SIGINT.
    """
    from speculators_v016.run.console import Console, scratch_log_path  # noqa: PLC0415 - imports torch; --help must not

    try:
        config = ServeConfig.build(
            _values_of(EngineConfig, values, SERVE_OPTIONS), **_values_of(ServeConfig, values, SERVE_OPTIONS)
        )
    except ConfigError as exc:
        raise usage_error(exc) from None
    with Console(scratch_log_path("serve"), obj["mode"], obj["log_level"]) as console:
        from speculators_v016.serve.driver import serve as run_service  # noqa: PLC0415 - torch, vLLM; off --help

        code = run_service(config, console)
        console.where()
    sys.exit(code)


@cli.command()
@config_options(DEMO_OPTIONS)
@click.pass_obj
def demo(obj, **values):
    """Run the whole pipeline on a tiny random model and bundled sample conversations."""
    config = command_config(DemoConfig, values, DEMO_OPTIONS)
    from speculators_v016.run.console import Console, log_path  # noqa: PLC0415 - imports torch; --help must not

    with Console(log_path(config.directory, "demo"), obj["mode"], obj["log_level"]) as console:
        from speculators_v016.run.demo import run_demo  # noqa: PLC0415 - torch, transformers; off --help

        code = run_demo(config.directory, config.format, console)
    sys.exit(code)


@cli.command("clean-shm")
@config_options(CLEAN_SHM_OPTIONS)
def clean_shm(**values):
    """List (and with --yes delete) the shared memory that dead runs of ours recorded in /dev/shm.

    Every run records the segments its processes create (our capture ring,
    vLLM's psm_* queues, multiprocessing's sem.mp-* semaphores) under a lock it
    holds while it lives; a run finds and deletes dead runs' segments at start.
    This command does the same on demand: only recorded names of runs whose lock
    is free, and only while each is still the recorded file. A run killed before
    it recorded a segment (within a second of its creation, during engine start)
    leaves a name no record holds: it is not touched here; remove it by hand.
    """
    from speculators_v016.shared.shm_records import reclaim, report_lines  # noqa: PLC0415 - +10 ms on --help

    config = command_config(CleanShmConfig, values, CLEAN_SHM_OPTIONS)
    result = reclaim(config.shm_dir, delete=config.yes)
    for line in report_lines(result, config.shm_dir, deleted=config.yes):
        click.echo(line)
    sys.exit(ExitCode.OK)


name_variables(cli)  # every command defined: each option's variable by the rule, none derived by click

_INT = re.compile(r"[+-]?\d+(,[+-]?\d+)*,?")


def _join_multi_value(argv: list[str], option: str) -> list[str]:
    """Upstream took ``--layer-ids 2 16 29 31`` (argparse nargs='+'); click takes one value. The values are the
    arguments that follow and do not start with ``-``, or are integers (``-1``: refused with its own message)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        if arg == option or arg.startswith(option + "="):
            values = [arg.partition("=")[2]] if "=" in arg else []
            while i + 1 < len(argv) and (not argv[i + 1].startswith("-") or _INT.fullmatch(argv[i + 1])):
                values.append(argv[i + 1])
                i += 1
            out += [option, " ".join(v for v in values if v)]
        else:
            out.append(arg)
        i += 1
    return out


def main() -> None:
    huge_pages.reexec()  # on a CPU build: this process again, glibc asked for huge pages (run/huge_pages.py)
    exit_gc.freeze_at_exit()  # after the run's own exit handlers: Python's last collections skip what it made
    cli.main(args=_join_multi_value(sys.argv[1:], "--layer-ids"), prog_name="speculators-data-gen")


if __name__ == "__main__":
    main()
