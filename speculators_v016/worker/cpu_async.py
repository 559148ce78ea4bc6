"""Let vLLM 0.16's CPU model runner build its async-scheduling output.

With async scheduling, ``GPUModelRunner.sample_tokens`` (which the CPU runner
inherits) wraps its result in ``AsyncGPUModelRunnerOutput``, whose
constructor starts a device-to-host copy on a CUDA stream
(``torch.cuda.current_stream()``): on a machine without CUDA that raises
"Found no NVIDIA driver". On CPU the tensors already live on the host, so the
copy is a plain clone and there is nothing to wait for.

:func:`install` swaps, in the worker process only and only when the runner's
device is the CPU, the name the runner looks up for a subclass that does just
that. GPU workers are never touched.
"""

from __future__ import annotations

import torch


class _Done:
    """Stands in for the copy-ready CUDA event: host copies are done at once."""

    def record(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _cpu_output_class(base: type) -> type:
    def __init__(
        self,
        model_runner_output,
        sampled_token_ids,
        logprobs_tensors,
        invalid_req_indices,
        async_output_copy_stream,
        vocab_size,
    ):
        self._model_runner_output = model_runner_output
        self._invalid_req_indices = invalid_req_indices
        self.async_copy_ready_event = _Done()
        self._sampled_token_ids = sampled_token_ids
        self.vocab_size = vocab_size
        self._logprobs_tensors = logprobs_tensors
        # The runner reuses its sampling buffers: keep a copy, as the GPU path does.
        self.sampled_token_ids_cpu = sampled_token_ids.clone()
        self._logprobs_tensors_cpu = logprobs_tensors

    return type("CpuAsyncModelRunnerOutput", (base,), {"__init__": __init__, "__module__": __name__})


def install(device: torch.device) -> bool:
    """Use the CPU output class in this process if ``device`` is the CPU; return whether it did."""
    if device.type != "cpu":
        return False
    from vllm.v1.worker import gpu_model_runner  # noqa: PLC0415 - vLLM: tests/gpu run without it

    current = gpu_model_runner.AsyncGPUModelRunnerOutput
    if current.__name__ != "CpuAsyncModelRunnerOutput":
        gpu_model_runner.AsyncGPUModelRunnerOutput = _cpu_output_class(current)
    return True
