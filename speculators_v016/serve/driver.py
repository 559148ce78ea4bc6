"""``speculators-data-gen serve``: start the service, print where it listens, serve until SIGTERM or SIGINT.

The start line names the address, the model's layers and the serve folder; a
line every ``STATUS_INTERVAL`` seconds goes to the log (samples and tokens per
second, GiB/s published, bytes not yet taken). The exit code says how it ended:
0 when asked to stop, the run's codes otherwise (5 the engine failed, 7 the
self-check, 4 the folder refused, 3 a bad dataset).
"""

from __future__ import annotations

import signal
import threading
import time

from loguru import logger
from transformers import AutoTokenizer

from speculators_v016.config import ServeConfig
from speculators_v016.engine.engine_args import check_engine_args
from speculators_v016.exit_codes import ExitCode
from speculators_v016.run.prepared import prepare_samples
from speculators_v016.run.run_report import exit_code
from speculators_v016.serve.auth import ApiKeyError, api_key_of, exposure_warning
from speculators_v016.serve.folder import ServeDirError
from speculators_v016.serve.http_api import HttpFront
from speculators_v016.serve.service import CaptureService
from speculators_v016.shared.shm_records import reclaim_and_log

STATUS_INTERVAL = 30.0


def load_samples(config: ServeConfig):
    """The service's dataset (``--train-data-path``), tokenized as a run's, or None."""
    if not config.train_data_path:
        return None
    tokenizer = AutoTokenizer.from_pretrained(
        config.engine.tokenizer, trust_remote_code=config.engine.trust_remote_code
    )
    return prepare_samples(
        list(config.train_data_path),
        tokenizer,
        config.seq_length,
        max_samples=config.max_samples,
        seed=config.seed,
        num_proc=config.num_preprocessing_workers,
    )


def status_line(service: CaptureService, since: tuple[float, int, int, int]) -> tuple[str, tuple]:
    at, served, tokens, nbytes = since
    now, stats = time.monotonic(), service.stats
    seconds = max(now - at, 1e-9)
    line = (
        f"served {stats.served} samples ({(stats.served - served) / seconds:.1f}/s, "
        f"{(stats.tokens - tokens) / seconds:,.0f} tok/s, {(stats.bytes - nbytes) / seconds / 2**30:.2f} GiB/s); "
        f"published, not yet taken: {service.backend.not_taken():,} bytes"
    )
    return line, (now, stats.served, stats.tokens, stats.bytes)


def serve(config: ServeConfig, console) -> int:
    """Serve until asked to stop; return the exit code."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        api_key = api_key_of(config.api_key, config.api_key_file)
    except ApiKeyError as exc:
        console.failure(f"error: {exc}")
        return ExitCode.USAGE
    warning = exposure_warning(config.host, api_key)
    if warning:
        logger.warning("{}", warning)
        console.echo(f"warning: {warning}", err=True)
    try:
        check_engine_args(config.engine)  # vLLM takes --engine-args, before the dataset is read
        reclaim_and_log()
        service = CaptureService(config, load_samples(config)).start()
    except ServeDirError as exc:
        console.failure(f"error: {exc}")
        return ExitCode.OUTPUT_REFUSED
    except Exception as exc:  # noqa: BLE001 - every failure gets a message and an exit code
        console.failure(f"error: {type(exc).__name__}: {exc}")
        console.log_exception(exc)
        return exit_code(exc)
    try:
        front = HttpFront.for_config(service, config, api_key).start()
    except OSError as exc:
        service.stop()
        console.failure(f"error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}")
        return ExitCode.USAGE
    reclaimed = service.backend.reclaimed.dead_service
    where = config.serve_dir if config.backend == "folder" else f"the Mooncake store (master {service.backend.address})"
    dataset = f"{len(service.samples)} samples of --train-data-path" if service.samples else "token ids from clients"
    console.echo(
        f"serving {config.engine.model} at {front.url}: layers {list(service.plan.layer_ids)}, "
        f"{service.info()['dtype']}, {dataset}; publishing to {where}"
        + (f" (reclaimed {reclaimed} files a stopped service published)" if reclaimed else ""),
        summary=True,
    )
    since = (time.monotonic(), 0, 0, 0)
    try:
        while not stop.wait(1.0) and service.failure is None:
            if time.monotonic() - since[0] >= STATUS_INTERVAL:
                line, since = status_line(service, since)
                logger.info("{}", line)
    finally:
        front.stop()
        service.stop()
    line, _ = status_line(service, (service.stats.started, 0, 0, 0))
    console.echo(line, summary=True)
    if isinstance(service.failure, ServeDirError):
        console.failure(f"error: {service.failure}")
        return ExitCode.OUTPUT_REFUSED
    if service.failure is not None:
        console.failure(f"error: the service's engine failed: {type(service.failure).__name__}: {service.failure}")
        return exit_code(service.failure)
    return ExitCode.OK
