"""The AMX block-size workaround: asked for exactly where vLLM 0.16's CPU attention would refuse bf16."""

import pytest

from speculators_v016.engine import cpu_attention


@pytest.fixture
def machine(monkeypatch):
    """set(cpu=..., amx=...): the platform and processor the decision sees."""

    def set_(cpu: bool, amx: bool):
        monkeypatch.setattr(cpu_attention, "on_cpu_platform", lambda: cpu)
        monkeypatch.setattr(cpu_attention, "amx_tiles", lambda: amx)

    return set_


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "bf16", "torch.bfloat16"])
def test_bf16_on_an_amx_cpu_gets_block_size_16(machine, dtype):
    """A bf16 (or auto) engine on a CPU with AMX asks for block size 16 (vLLM's vec16 kernels)."""
    machine(cpu=True, amx=True)
    assert cpu_attention.attention_overrides(dtype, {}) == {"block_size": 16}


@pytest.mark.parametrize("dtype", ["float32", "float16", "half"])
def test_other_dtypes_keep_vllms_block_size(machine, dtype):
    """fp32 and fp16 never take the AMX kernels: nothing is changed."""
    machine(cpu=True, amx=True)
    assert cpu_attention.attention_overrides(dtype, {}) == {}


def test_no_amx_or_no_cpu_changes_nothing(machine):
    """Without AMX tiles, or on a GPU platform, vLLM's default block size stays."""
    machine(cpu=True, amx=False)
    assert cpu_attention.attention_overrides("bfloat16", {}) == {}
    machine(cpu=False, amx=True)
    assert cpu_attention.attention_overrides("bfloat16", {}) == {}


def test_a_block_size_the_caller_chose_is_kept(machine):
    """An explicit block_size (extra engine arguments) wins over the workaround."""
    machine(cpu=True, amx=True)
    assert cpu_attention.attention_overrides("bfloat16", {"block_size": 32}) == {}


def test_the_probe_is_torchs_own():
    """amx_tiles() answers what torch tells vLLM (a bool on this machine, whatever its processor)."""
    assert isinstance(cpu_attention.amx_tiles(), bool)
