"""The variables vLLM's workers read, checked before they start; CPU workers bound where vLLM's binding asserts."""

import pytest

from speculators_v016.config import ConfigError
from speculators_v016.engine import worker_env
from speculators_v016.engine.worker_env import BIND, PARTITION, cpu_binding, needs_binding, partition_problem


@pytest.mark.parametrize(
    "value, problem",
    [
        ("3,4", "the entries sum to 7, the target has 8 layers"),
        ("8", "1 entries, --pipeline-parallel-size is 2: one entry per stage"),
        ("4,x", "'x' not a whole number >= 1"),
        ("0,8", "'0' not a whole number >= 1 (each stage holds at least one layer)"),
        ("-1,9", "'-1' not a whole number >= 1"),
        ("4,", "'' not a whole number >= 1"),
    ],
)
def test_a_malformed_layer_partition_is_named(value, problem):
    """Count, sum and each entry of VLLM_PP_LAYER_PARTITION are checked against PP 2 of 8 layers."""
    assert problem in partition_problem(value, 2, 8)


@pytest.mark.parametrize("value", ["3,5", "4,4", " 3, 5"])
def test_a_good_layer_partition_passes(value):
    """Entries >= 1, one per stage, summing to the layer count."""
    assert partition_problem(value, 2, 8) is None


def test_the_partition_error_names_the_variable_and_an_example():
    """The usage error names the variable, its value, what is wrong and a split that works."""
    with pytest.raises(ConfigError) as raised:
        worker_env.check({PARTITION: "3,4"}, cpu=False, workers=2, stages=2, num_layers=lambda: 61)
    assert str(raised.value) == (
        "environment variable VLLM_PP_LAYER_PARTITION='3,4': the entries sum to 7, the target has 61 layers "
        "(vLLM's layers per pipeline stage, e.g. '31,30'; or unset it for vLLM's even split)"
    )


def test_the_layer_count_is_read_only_where_the_partition_is_set():
    """Without VLLM_PP_LAYER_PARTITION the target's config is not read."""
    worker_env.check({}, cpu=True, workers=1, stages=1, num_layers=lambda: pytest.fail("read"))


@pytest.mark.parametrize("binding", ["0", "0|", "0||1"])
def test_a_cpu_binding_with_too_few_entries_is_refused(binding):
    """VLLM_CPU_OMP_THREADS_BIND with fewer non-empty entries than workers: a usage error naming it."""
    with pytest.raises(ConfigError, match=r"environment variable VLLM_CPU_OMP_THREADS_BIND='.*' names the cores of"):
        worker_env.check({BIND: binding}, cpu=True, workers=3 if binding == "0||1" else 2, stages=2, num_layers=8)


@pytest.mark.parametrize("binding", ["0|1", "auto", "nobind", "0-3|4-7|8"])
def test_a_usable_cpu_binding_passes(binding):
    """One entry per worker (or more), or vLLM's own values."""
    worker_env.check({BIND: binding}, cpu=True, workers=2, stages=2, num_layers=8)


@pytest.mark.parametrize(
    "cores, workers, binding",
    [
        ({0, 1}, 2, "0|1"),
        ({0, 1}, 4, "0|1|0|1"),
        ({0}, 2, "0|0"),
        (set(range(8)), 2, "0-3|4-7"),
        (set(range(7)), 2, "0-3|4-6"),
        ({0, 1, 2, 5, 6, 9}, 2, "0-2|5-6,9"),
    ],
)
def test_the_binding_splits_the_allowed_cores(cores, workers, binding):
    """Contiguous shares of the allowed cores, the first ones a core more; fewer cores than workers: in turn."""
    assert cpu_binding(cores, workers) == binding


@pytest.mark.parametrize(
    "environ, cpu, workers, nodes, needed",
    [
        ({}, True, 2, 1, True),
        ({BIND: "auto"}, True, 2, 1, True),
        ({}, True, 2, 2, False),  # a NUMA node per worker: vLLM's own binding works
        ({}, True, 1, 1, False),
        ({}, False, 2, 1, False),
        ({BIND: "0|1"}, True, 2, 1, False),  # the user's
        ({BIND: "nobind"}, True, 2, 1, False),
        ({"VLLM_CPU_SIM_MULTI_NUMA": "1"}, True, 2, 1, False),
    ],
)
def test_cores_are_bound_only_where_vllms_binding_would_assert(environ, cpu, workers, nodes, needed):
    """Set only for CPU engines of several workers on fewer NUMA nodes, the variable unset or auto."""
    assert needs_binding(environ, cpu, workers, lambda: nodes) is needed


def test_the_binding_is_set_while_the_workers_start_then_restored(monkeypatch):
    """The variable holds the binding inside the block (the workers inherit it), and is gone after."""
    monkeypatch.setattr(worker_env, "_allowed_numa_nodes", lambda: 1)
    monkeypatch.setattr(worker_env.os, "sched_getaffinity", lambda pid: {0, 1})
    environ = {}
    with worker_env.workers_bound(True, 2, environ) as binding:
        assert binding == "0|1" and environ == {BIND: "0|1"}
    assert environ == {}
    with worker_env.workers_bound(True, 2, {BIND: "0|0"}) as binding:
        assert binding is None
