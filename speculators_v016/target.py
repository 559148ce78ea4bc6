"""What we need to know of the target before starting an engine, read once from its config."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoConfig


class PromptError(ValueError):
    """A prompt that cannot be run (empty, or token ids outside the vocabulary)."""


class RemoteCodeError(ValueError):
    """The model needs code from its own folder or repository, and the user did not allow it."""


class ContextLengthError(ValueError):
    """The run's --seq-length (plus the one sampled token) is longer than the model's context."""


@dataclass(frozen=True)
class TargetInfo:
    """The target's decoder depth and vocabulary, from its config (text config for multimodal models)."""

    path: str
    num_layers: int
    vocab_size: int

    @classmethod
    def read(cls, model_path: str, trust_remote_code: bool = False) -> TargetInfo:
        try:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except ValueError as exc:
            if "trust_remote_code" not in str(exc):
                raise
            raise RemoteCodeError(
                f"{model_path} needs its own Python code to load (auto_map); refused. "
                "Pass --trust-remote-code (trust_remote_code=True) only if you trust it."
            ) from exc
        configs = [c for c in (config, getattr(config, "text_config", None)) if c is not None]
        layers = next((int(c.num_hidden_layers) for c in configs if getattr(c, "num_hidden_layers", None)), None)
        if layers is None:
            raise ValueError(
                f"cannot tell how many decoder layers {model_path} has: its config "
                "has no num_hidden_layers (nor text_config.num_hidden_layers)"
            )
        vocab = next((int(c.vocab_size) for c in configs if getattr(c, "vocab_size", None)), 0)
        return cls(str(model_path), layers, vocab)


def check_token_ids(key, ids: list[int], vocab_size: int, where: str = "") -> None:
    """Refuse token ids outside ``[0, vocab_size)``, naming the prompt (the one vocabulary check)."""
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise PromptError(f"prompt {key!r} has token ids outside the vocabulary{where} [0, {vocab_size}): {bad[:5]}")


class GenerationSetupError(ValueError):
    """The target cannot regenerate as asked (no generation prompt in its chat template, no sampling settings)."""
