"""A warm interpreter for the CLI tests: the real command, a fresh process per run, without its imports.

Two thirds of a small run of ``speculators-data-gen`` on CPU is its interpreter importing torch,
transformers, datasets and vLLM (12-15 s of a 20-25 s run on CI's two cores). This script, run once
per pytest process, imports them and then forks one child per run: the child takes the run's working
directory, environment, argv and output files, and runs the command's module as ``python -m`` does,
ending as any interpreter ends (threads joined, ``atexit``, its exit status). Each run is still its own
process, with its own pid for signals and faults; only the imports are shared.

A run goes through here only where nothing the imports read differs (``helpers.cli.invoke`` decides:
the same environment but for the command's own variables); any other run starts cold.

Protocol, one JSON object per line: stdin takes ``{module, args, env, cwd, stdout, stderr}``; the
answers are ``{"pid": n}`` once the child is forked and ``{"status": code}`` when it has ended
(``-signal`` when a signal ended it, as ``subprocess`` reports).
"""

import os
import sys

del sys.path[0]  # this script's folder (tests/helpers) is no module path of the command's


def _preload() -> None:
    """What a run of the command imports, once."""
    import datasets  # noqa: F401, PLC0415
    import torch  # noqa: F401, PLC0415
    import transformers  # noqa: F401, PLC0415
    import transformers.models.auto.tokenization_auto  # noqa: F401, PLC0415
    import vllm  # noqa: F401, PLC0415
    import vllm.v1.engine.core  # noqa: F401, PLC0415

    import speculators_v016.run.cli  # noqa: F401, PLC0415
    import speculators_v016.run.dataset  # noqa: F401, PLC0415
    import speculators_v016.run.pipeline  # noqa: F401, PLC0415
    import speculators_v016.run.run_report  # noqa: F401, PLC0415


def _serve() -> dict | None:
    """Fork a child per request; return the request in the child, None in the server at end of input."""
    import json  # noqa: PLC0415

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    requests = os.fdopen(os.dup(0), "r")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # what the imports print goes nowhere; the protocol has its own descriptors
    _preload()
    answers.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            answers.close()
            os.close(null)
            return request
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
    return None


def _become(request: dict) -> None:
    """In the child: take the run's directory, environment, output and argv, then run its module."""
    import runpy  # noqa: PLC0415

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(out, fd)
        os.close(out)
    sys.path.insert(0, os.getcwd())  # as `python -m` puts it
    sys.argv = [request["module"], *request["args"]]
    sys.modules.pop(request["module"], None)  # run as __main__, as `python -m` runs it: not the preloaded copy
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    request = _serve()
    if request is not None:
        _become(request)
