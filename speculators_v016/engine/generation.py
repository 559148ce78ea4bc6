"""Requests that generate: what the target samples, where it stops, and which rows the sample holds.

A generating request (``--regenerate``) is a prompt with a :class:`Generation`: the target samples
up to ``max_new_tokens`` tokens and its capture covers the prompt (prefill rows) and every sampled
token (one decode row per step). vLLM never feeds a request's last sampled token back, so its state
would be missing: the request runs one step past its end (vLLM is given ``max_new_tokens + 1`` and
``ignore_eos``; the stop decision is ours, :meth:`Decoding.add`), that step's decode row is the last
token's state, and what it sampled is dropped. A sample is then ``prompt + generated`` with a state
for every position, as a prefill capture of the same sequence has (the proof the tests run), and its
last label, the end-of-turn token, keeps the state that predicts it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Generation:
    """How one request samples: vLLM's sampling settings, the stop tokens, and the cap."""

    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off (vLLM's -1)
    seed: int | None = None  # per request: the same tokens whatever the batch around it
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: bool = False  # vLLM's log p of each sampled token (the logit check's)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")

    def sampling_params(self, prompt_logprobs: bool = False):
        """vLLM's SamplingParams: one token past the cap, EOS ignored (the stop is ours, :class:`Decoding`)."""
        from vllm.sampling_params import SamplingParams  # noqa: PLC0415 - vLLM only where an engine runs

        return SamplingParams(
            max_tokens=self.max_new_tokens + 1,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1,
            seed=self.seed,
            ignore_eos=True,
            logprobs=0 if self.logprobs else None,
            prompt_logprobs=0 if prompt_logprobs else None,
            skip_special_tokens=False,
        )


def sample_seed(run_seed: int, index: int) -> int:
    """The seed of sample ``index``: fixed by the run's seed and the index alone (resume, shards, any batch)."""
    digest = hashlib.blake2b(f"{run_seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Generated:
    """What a generating request produced: the sampled ids (the stop token included), why it ended,
    and vLLM's log p of each sampled token when asked."""

    prompt_len: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[float] | None = None

    @property
    def length(self) -> int:
        """Tokens of the sample: the prompt and what was generated."""
        return self.prompt_len + len(self.token_ids)


class Decoding:
    """One request's sampled tokens as the steps report them, until its stop."""

    def __init__(self, prompt_len: int, generation: Generation):
        self.generation = generation
        self.result = Generated(prompt_len, logprobs=[] if generation.logprobs else None)

    @property
    def finished(self) -> bool:
        return self.result.finish_reason is not None

    def add(self, token_ids: list[int], logprobs=None) -> bool:
        """Take a step's new tokens; True when this step ended the sample (stop token or cap).

        Tokens after the end (the step past it) are dropped."""
        if self.finished:
            return False
        g, out = self.generation, self.result
        for k, token in enumerate(token_ids):
            out.token_ids.append(int(token))
            if out.logprobs is not None:
                if logprobs is None:
                    raise RuntimeError("vLLM returned no logprobs for a request that asked for them")
                if int(logprobs.logprob_token_ids[k, 0]) != int(token):
                    raise RuntimeError(
                        f"vLLM's logprobs name token {int(logprobs.logprob_token_ids[k, 0])} for sampled token {token}"
                    )
                out.logprobs.append(float(logprobs.logprobs[k, 0]))
            if token in g.stop_token_ids:
                out.finish_reason = "stop"
            elif len(out.token_ids) >= g.max_new_tokens:
                out.finish_reason = "length"
            if self.finished:
                return True
        return False
