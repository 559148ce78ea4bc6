"""How vLLM's workers start: spawned wherever they use a GPU (forked ones cannot use CUDA), vLLM's choice on CPU."""

import os

import pytest

from speculators_v016.engine.worker_start import VARIABLE, set_start_method, start_method


@pytest.mark.parametrize(
    "device, kind, expected",
    [
        ("cuda", "mp", "spawn"),
        ("xpu", "mp", "spawn"),
        ("cpu", "mp", None),
        ("cuda", "uni", None),
        ("cuda", "ray", None),
    ],
)
def test_workers_on_gpus_are_spawned(device, kind, expected):
    """mp workers on a GPU platform: spawn; CPU, in-process and Ray workers: vLLM's own choice."""
    assert start_method(device, kind) == expected


def test_a_forked_choice_is_replaced_and_vllms_cached_environment_reset(monkeypatch):
    """VLLM_WORKER_MULTIPROC_METHOD=fork on a GPU engine: spawn, also where vLLM had cached its environment."""
    from vllm import envs  # noqa: PLC0415 - vLLM, as the engine imports it

    envs.disable_envs_cache()  # an engine of an earlier test in this process may have cached another value
    monkeypatch.setenv(VARIABLE, "fork")
    envs.enable_envs_cache()
    try:
        assert envs.VLLM_WORKER_MULTIPROC_METHOD == "fork"
        assert set_start_method("cuda", "mp") == "spawn"
        assert os.environ[VARIABLE] == "spawn" and envs.VLLM_WORKER_MULTIPROC_METHOD == "spawn"
    finally:
        envs.disable_envs_cache()


def test_cpu_engines_leave_the_choice_to_vllm(monkeypatch):
    """On CPU nothing is set (vLLM's CPU platform picks its own method)."""
    monkeypatch.delenv(VARIABLE, raising=False)
    assert set_start_method("cpu", "mp") is None
    assert VARIABLE not in os.environ
