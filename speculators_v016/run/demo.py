"""``speculators-data-gen demo``: the whole pipeline, offline, on a tiny model.

Builds a random-weight Llama (8 layers, hidden 128) with a locally
trained tokenizer and chat template, takes the sample conversations shipped
in this package (written for it), generates hidden states with the installed
vLLM 0.16, verifies the folder, and shows what a sample holds.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from speculators_v016.config import RunConfig
from speculators_v016.exit_codes import ExitCode
from speculators_v016.run.run_report import run_and_report
from speculators_v016.store.sample_format import load_sample
from speculators_v016.testing.tiny_models import DEFAULT_CORPUS, build_tiny_model

CONVERSATIONS = "conversations.jsonl"
SEQ_LENGTH = 512


def bundled_conversations() -> Path:
    return Path(str(resources.files("speculators_v016.run") / "demo_data" / CONVERSATIONS))


def corpus_lines() -> list[str]:
    lines = []
    for row in bundled_conversations().read_text().splitlines():
        lines += [t["value"] for t in json.loads(row)["conversations"]]
    return lines


def run_demo(where: Path, fmt: str, console) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the CPU default takes half the RAM
    where = Path(where)
    model = where / "model"
    if not (model / "config.json").exists():
        console.echo(f"building a tiny random Llama in {model} ...")
        build_tiny_model(model, "llama", corpus=DEFAULT_CORPUS + corpus_lines())
    data = where / f"data-{fmt}"
    # the CLI's own dtype (auto: bfloat16 on CPU), as users run it; eager: a compiled start costs a minute
    opts = RunConfig.build(
        {"model": str(model), "tensor_parallel_size": 1, "enforce_eager": True, "max_num_seqs": 8},
        train_data_path=(str(bundled_conversations()),),
        output_dir=data,
        seq_length=SEQ_LENGTH,
        format=fmt,
        token_freq_path=str(where / "token_freq.pt"),
        num_preprocessing_workers=1,
        deep_verify=True,
        num_shards=1,
        shard_index=0,
    )
    code = run_and_report(opts, console)
    if code != ExitCode.OK:
        return code
    config = json.loads((data / "data_config.json").read_text())
    layers = config["speculators_v016"]["layers"]
    first = sorted(data.glob(f"data_*.{'safetensors' if fmt == 'safetensors' else 'pt'}"))[0]
    sample = load_sample(first)
    console.echo("", summary=True)
    console.echo(summary=True, line=f"model:      {model} ({layers['num_hidden_layers']} layers)")
    count = len((data / "manifest.jsonl").read_text().splitlines())
    console.echo(summary=True, line=f"data:       {data} ({count} sample files, manifest.jsonl, data_config.json)")
    console.echo(summary=True, line=f"layers:     {layers['layer_ids']} (output of layer L, before the final norm)")
    console.echo(
        summary=True,
        line=f"serve with: eagle_aux_hidden_state_layer_ids = {layers['eagle_aux_hidden_state_layer_ids']}",
    )
    console.echo(
        summary=True,
        line=f"a sample:   {first.name}: input_ids {tuple(sample['input_ids'].shape)}, "
        f"loss_mask {tuple(sample['loss_mask'].shape)} ({int(sample['loss_mask'].sum())} trainable), "
        f"hidden_states {len(sample['hidden_states'])} x {tuple(sample['hidden_states'][0].shape)} "
        f"{sample['hidden_states'][0].dtype}",
    )
    return ExitCode.OK
