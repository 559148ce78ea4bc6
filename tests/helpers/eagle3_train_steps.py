"""A few steps of upstream's EAGLE-3 trainer on a folder we generated (run by test_cli.py), or on the
same samples asked of a running ``speculators-data-gen serve`` (test_serve.py): prints the losses.

Usage: python eagle3_train_steps.py MODEL_DIR DATA_DIR TOKEN_FREQ SAVE_DIR [PRODUCER_URL]
DATA_DIR's samples 0-3 (by index), or, with PRODUCER_URL, the service's samples 0-3 through
OnlineSampleDataset, read by two forked DataLoader workers. The draft's weights are seeded.
With RANK and WORLD_SIZE set: this rank's batches of all samples, packed by upstream's
MultipackDistributedBatchSamplerV2 on the exact token counts (upstream's Trainer runs one process
per rank here: its distributed mode needs CUDA for FSDP).
Runs with TORCHDYNAMO_DISABLE=1: the draft's flex attention does not compile on
CPU with torch 2.10's inductor; eager is fine for a tiny model.
"""

import json
import os
import sys
from pathlib import Path

import torch
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators.train.trainer import Trainer, TrainerConfig
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from torch.utils.data import DataLoader, Subset
from transformers import AutoConfig, LlamaConfig

from speculators_v016.online import OnlineSampleDataset
from speculators_v016.store.sample_format import load_sample


def main(model_dir: str, data_dir: str, token_freq: str, save_dir: str, producer: str | None = None) -> None:
    torch.manual_seed(0)
    target = AutoConfig.from_pretrained(model_dir)
    layers = json.loads((Path(data_dir) / "data_config.json").read_text())["speculators_v016"]["layers"]
    d2t, t2d = build_vocab_mappings_from_distribution(torch.load(token_freq, weights_only=True), 64, target.vocab_size)
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=LlamaConfig(
            hidden_size=target.hidden_size,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_hidden_layers=1,
            vocab_size=target.vocab_size,
            attn_implementation="simple_flex_attention",
        ),
        draft_vocab_size=64,
        eagle_aux_hidden_state_layer_ids=layers["eagle_aux_hidden_state_layer_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=model_dir, architectures=["LlamaForCausalLM"]),
        ),
    )
    model = Eagle3DraftModel(config, t2d=t2d, d2t=d2t)
    losses = []
    model.register_forward_hook(lambda _module, _args, out: losses.append(out[1].item()))
    ranks = "WORLD_SIZE" in os.environ
    count = len(list(Path(data_dir).glob("data_*.safetensors"))) if ranks else 4
    if producer is None:
        files = [str(Path(data_dir) / f"data_{i}.safetensors") for i in range(count)]
        dataset, workers = Eagle3SampleFileDataset(max_len=256, file_list=files), 0
        lengths = [len(load_sample(f)["input_ids"]) for f in files]  # exact, as the service's
    else:
        dataset, workers = OnlineSampleDataset(producer, max_len=256), 2
        lengths = dataset.approx_lengths[:count]
    collate = create_collate_fn(256)
    if ranks:
        sampler = MultipackDistributedBatchSamplerV2(
            256, lengths, int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        )
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers)
    else:
        loader = DataLoader(Subset(dataset, range(4)), batch_size=1, collate_fn=collate, num_workers=workers)
    trainer = Trainer(
        model, TrainerConfig(lr=1e-3, num_epochs=1, save_path=save_dir, local_rank="cpu", scheduler_type="none"), loader
    )
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    trainer.train_epoch(0)
    after = [p for p in model.parameters() if p.requires_grad]
    changed = any(not torch.equal(a, b) for a, b in zip(before, after))
    finite = all(bool(torch.isfinite(p).all()) for p in after)
    print(json.dumps({"steps": trainer.global_step, "changed": changed, "finite": finite, "losses": losses}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
