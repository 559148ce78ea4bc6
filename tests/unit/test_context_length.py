"""vLLM's refusal of a max_model_len past the model's context becomes an error naming --seq-length and what fits."""

from speculators_v016.engine.context_length import context_length_error
from speculators_v016.target import ContextLengthError

VLLM_MESSAGE = (  # vLLM 0.16's ValidationError text (ModelConfig), as seen on a tiny model of context 4096
    "1 validation error for ModelConfig\n  Value error, User-specified max_model_len (4097) is greater than the "
    "derived max_model_len (max_position_embeddings=4096.0 or model_max_length=None in model's config.json). "
    "To allow overriding this maximum, set the env var VLLM_ALLOW_LONG_MAX_MODEL_LEN=1."
)


def test_vllms_refusal_names_the_option_and_the_value_that_fits():
    """max_model_len 4097 over a context of 4096: --seq-length 4096 named, 4095 or less offered."""
    error = context_length_error(ValueError(VLLM_MESSAGE))
    assert isinstance(error, ContextLengthError) and isinstance(error, ValueError)
    assert str(error).startswith("--seq-length 4096 does not fit the model's context")
    assert "Give --seq-length 4095 or less" in str(error) and "max_position_embeddings=4096.0" in str(error)


def test_other_errors_are_left_alone():
    """Anything else vLLM raises is not taken for a context-length problem."""
    assert context_length_error(ValueError("max_num_batched_tokens (8) is smaller than max_num_seqs")) is None
