"""A few steps of upstream's EAGLE-3 trainer on a folder we generated (run by test_cli.py).

Usage: python eagle3_train_steps.py MODEL_DIR DATA_DIR TOKEN_FREQ SAVE_DIR
Runs with TORCHDYNAMO_DISABLE=1: the draft's flex attention does not compile on
CPU with torch 2.10's inductor; eager is fine for a tiny model.
"""

import json
import sys
from pathlib import Path

import torch
from speculators import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.data import Eagle3SampleFileDataset, create_collate_fn
from speculators.train.trainer import Trainer, TrainerConfig
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from torch.utils.data import DataLoader, Subset
from transformers import AutoConfig, LlamaConfig


def main(model_dir: str, data_dir: str, token_freq: str, save_dir: str) -> None:
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
    dataset = Eagle3SampleFileDataset(max_len=256, datapath=data_dir)
    loader = DataLoader(Subset(dataset, range(4)), batch_size=1, collate_fn=create_collate_fn(256))
    trainer = Trainer(
        model, TrainerConfig(lr=1e-3, num_epochs=1, save_path=save_dir, local_rank="cpu", scheduler_type="none"), loader
    )
    before = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    trainer.train_epoch(0)
    after = [p for p in model.parameters() if p.requires_grad]
    changed = any(not torch.equal(a, b) for a, b in zip(before, after))
    finite = all(bool(torch.isfinite(p).all()) for p in after)
    print(json.dumps({"steps": trainer.global_step, "changed": changed, "finite": finite}))


if __name__ == "__main__":
    main(*sys.argv[1:5])
