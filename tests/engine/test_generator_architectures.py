"""Qwen3, Qwen3-MoE (built-in aux outputs) and Mixtral (our taps adapter) against transformers."""

from helpers.reference import NUM_LAYERS, TOLERANCE, hf_layer_outputs, max_abs_error, random_prompts
from speculators_v016.generator import VllmHiddenStatesGenerator

LAYERS = list(range(NUM_LAYERS))
LENGTHS = [40, 333, 3, 128, 77]
ENGINE = dict(layer_ids=LAYERS, max_model_len=512, dtype="float32", max_num_batched_tokens=128, max_num_seqs=3)


def check(model_dir, builtin: bool, record=None, name="", **options):
    prompts = random_prompts(LENGTHS, seed=3)
    with VllmHiddenStatesGenerator(model_dir, **{**ENGINE, **options}) as gen:
        info = gen.engine.capture_info[0]
        results = gen.generate(prompts)
    if builtin:  # vLLM's own EAGLE-3 path for 1..n-1, our tap only after the last layer
        assert info["builtin_ids"] == list(range(1, NUM_LAYERS)) and info["tap_ids"] == [NUM_LAYERS]
    else:
        assert info["builtin_ids"] == [] and info["tap_ids"] == list(range(1, NUM_LAYERS + 1))
    worst = max_abs_error(results, hf_layer_outputs(model_dir, prompts), LAYERS)
    if record is not None:
        record(
            name,
            info["model_class"],
            "built-in" if builtin else "taps",
            "engine (CPU, fp32, eager and compiled)" if name == "mixtral" else "engine (CPU, fp32)",
            worst,
            TOLERANCE,
        )
    assert worst < TOLERANCE
    return info


def test_qwen3_builtin(tiny_model, record_architecture):
    """Qwen3 through vLLM's built-in aux outputs equals transformers within 1e-5."""
    info = check(tiny_model("qwen3"), builtin=True, record=record_architecture, name="qwen3", enforce_eager=True)
    assert info["model_class"] == "Qwen3ForCausalLM"


def test_qwen3_moe_builtin(tiny_model, record_architecture):
    """Qwen3-MoE through vLLM's built-in aux outputs equals transformers within 1e-5."""
    info = check(
        tiny_model("qwen3_moe"), builtin=True, record=record_architecture, name="qwen3_moe", enforce_eager=True
    )
    assert info["model_class"] == "Qwen3MoeForCausalLM"


def test_mixtral_adapter_eager(tiny_model, record_architecture):
    """Mixtral (no SupportsEagle3) through our taps adapter equals transformers within 1e-5."""
    info = check(tiny_model("mixtral"), builtin=False, record=record_architecture, name="mixtral", enforce_eager=True)
    assert info["model_class"] == "MixtralForCausalLM"


def test_mixtral_adapter_compiled(tiny_model):
    """The taps adapter also works on the compiled path (installed before warm-up)."""
    check(tiny_model("mixtral"), builtin=False, enforce_eager=False)


def test_taps_on_a_builtin_model_equal_builtin(tiny_model):
    """Forcing taps on Llama gives transformers' states too (the adapter is model-agnostic)."""
    check(tiny_model("llama"), builtin=False, enforce_eager=True, capture_mode="taps")
