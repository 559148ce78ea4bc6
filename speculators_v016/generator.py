"""``VllmHiddenStatesGenerator`` with upstream speculators 0.3.0's contract, on vLLM 0.16.

``generate(token_ids)`` returns, in input order, one dict per prompt with
``input_ids`` (LongTensor), ``hidden_states`` (one ``[len, hidden]`` tensor
per requested layer, in request order) and ``loss_mask`` (None), as upstream
does. :meth:`VllmHiddenStatesGenerator.stream` yields the same dicts (plus
``index``) as soon as each prompt completes, for writers that work while the
engine runs. With ``hidden_states_dtype="fp8_e4m3"`` each layer of
``hidden_states`` is a :class:`~speculators_v016.fp8.Fp8States` (e4m3 codes
and one float32 scale per token; ``.dequantize()`` gives the values).

Library users call it with upstream's keywords; our pipeline builds the
:class:`~speculators_v016.config.EngineConfig` and the layer plan once and
uses :meth:`VllmHiddenStatesGenerator.from_config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence

import torch
from loguru import logger

from speculators_v016.config import EngineConfig, default_of
from speculators_v016.engine.core import CaptureEngine
from speculators_v016.engine.generation import Generation, sample_seed
from speculators_v016.layers import LayerPlan
from speculators_v016.target import RemoteCodeError, TargetInfo

__all__ = ["Generation", "RemoteCodeError", "VllmHiddenStatesGenerator", "num_decoder_layers"]


def _seeded(generation: Generation, index: int) -> Generation:
    """Prompt ``index``'s generation: its own seed from the given one and the index (None stays None)."""
    if generation.seed is None:
        return generation
    return dataclasses.replace(generation, seed=sample_seed(generation.seed, index))


def num_decoder_layers(model_path: str, trust_remote_code: bool = False) -> int:
    """Decoder layer count from the model's config (text config for multimodal models)."""
    return TargetInfo.read(model_path, trust_remote_code).num_layers


class VllmHiddenStatesGenerator:
    """Captures hidden states of selected layers during prefill, with vLLM 0.16.

    ``layer_ids`` use upstream's meaning: id ``L`` is the output of decoder
    layer ``L`` before the final norm (see :mod:`speculators_v016.layers`);
    default ``[2, n//2, n-3, n-1]``. Keyword arguments beyond upstream's
    (``async_scheduling``, ``enforce_eager``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``dtype``, ``executor``, ...) are fields of
    :class:`~speculators_v016.config.EngineConfig` (their defaults are its fields').
    """

    def __init__(
        self,
        model_path: str,
        layer_ids: Sequence[int] | None = None,
        max_model_len: int = default_of(EngineConfig, "max_model_len"),
        gpu_memory_utilization: float = default_of(EngineConfig, "gpu_memory_utilization"),
        tensor_parallel_size: int = default_of(EngineConfig, "tensor_parallel_size"),
        **engine_options,
    ):
        config = EngineConfig(
            model=model_path,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            **engine_options,
        )
        target = TargetInfo.read(model_path, config.trust_remote_code)
        self._start(config, LayerPlan.build(target.num_layers, layer_ids))

    @classmethod
    def from_config(cls, config: EngineConfig, plan: LayerPlan) -> VllmHiddenStatesGenerator:
        """A generator for a config and a layer plan that were already built (the pipeline's way)."""
        self = cls.__new__(cls)
        self._start(config, plan)
        return self

    def _start(self, config: EngineConfig, plan: LayerPlan) -> None:
        self.model_path = config.model
        self.plan = plan
        self.layer_ids = list(plan.layer_ids)
        logger.info("capturing layers {} of {} (vLLM aux ids {})", self.layer_ids, config.model, list(plan.vllm_ids))
        self.engine = CaptureEngine(config, plan)
        # Attributes upstream's generator had and its DataGenerationConfig reads.
        self.tensor_parallel_size = config.tensor_parallel_size
        self.vllm_config = self.engine.core.vllm_config

    @property
    def quantization(self) -> dict | None:
        """How the target is quantized, as data files record it: vLLM's method and the checkpoint's config."""
        model_config = self.vllm_config.model_config
        method = model_config.quantization
        if method is None:
            return None
        hf_config = getattr(model_config.hf_config, "quantization_config", None) or {}
        if not isinstance(hf_config, dict):
            hf_config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else vars(hf_config)
        return {"vllm_method": str(method), "checkpoint": hf_config}

    @property
    def layer_mapping(self) -> dict:
        """The layer ids in both conventions, as data files record them."""
        return self.plan.describe()

    def stream(
        self, token_ids: Iterable[Sequence[int]] | torch.Tensor, generation: Generation | None = None
    ) -> Iterator[dict]:
        """Yield ``{"index", "input_ids", "hidden_states", "loss_mask"}`` as each prompt completes.

        ``generation`` (on-policy data, as ``--regenerate``): the target continues each prompt as it
        says (sampling, stop tokens, cap; its ``seed``, if any, makes each prompt's seed with the prompt's
        index) and the states are captured in the same pass: ``input_ids`` is the prompt and the sampled
        ids, ``loss_mask`` 1 on the sampled ids, plus ``"finish_reason"`` ("stop" or "length").
        """
        rows = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
        feed = (
            enumerate(rows) if generation is None else ((i, ids, _seeded(generation, i)) for i, ids in enumerate(rows))
        )
        for index, ids, states in self.engine.stream(feed):
            item = {
                "index": index,
                "input_ids": torch.tensor(ids, dtype=torch.long),
                "hidden_states": states,
                "loss_mask": None,
            }
            if generation is not None:
                result = self.engine.generated.pop(index)
                item["loss_mask"] = torch.zeros(len(ids), dtype=torch.long)
                item["loss_mask"][result.prompt_len :] = 1
                item["finish_reason"] = result.finish_reason
            yield item

    def generate(self, token_ids: Sequence[Sequence[int]] | torch.Tensor) -> list[dict]:
        """Upstream's call: all results, in input order."""
        if len(token_ids) == 0:
            raise ValueError("token_ids cannot be empty")
        rows = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
        for index, ids in enumerate(rows):  # refuse bad input before anything is scheduled
            self.engine.check_prompt(index, ids, count=False)
        results: list[dict | None] = [None] * len(token_ids)
        for item in self.stream(rows):
            results[item.pop("index")] = item
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()

    def __enter__(self) -> VllmHiddenStatesGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # interpreter shutdown: nothing left to release
            pass
