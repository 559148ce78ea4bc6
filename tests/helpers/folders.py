"""A folder as a run writes it (data_config.json, sample files, their manifest lines), crafted without an engine:
what verify and the output folder's tests start from."""

import json

import torch

from speculators_v016.store.atomic_files import write_atomic
from speculators_v016.store.manifest import Entry, Manifest
from speculators_v016.store.sample_format import encode_parts, sample_name

LAYERS, HIDDEN = [2, 4, 7], 8


def config(count=3, shard=(0, 1)) -> dict:
    return {
        "model": {"hidden_size": HIDDEN},
        "speculators_v016": {
            "format": "safetensors",
            "layers": {"layer_ids": LAYERS},
            "dtype": "float32",
            "shard": {"index": shard[0], "count": shard[1], "samples": count},
            "dataset_samples": count,
            "start_idx": 0,
        },
    }


def states(length: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(length, HIDDEN, generator=gen) for _ in LAYERS]


def make_folder(folder, count=3, make_states=states, shard=(0, 1), indices=None, algorithm="blake3"):
    """A folder as a run writes it: data_config.json, sample files, their manifest lines."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data_config.json").write_text(json.dumps(config(count, shard)))
    manifest = Manifest(folder)
    for i in indices if indices is not None else range(count):
        length = 5 + i
        sample = {
            "input_ids": torch.arange(10, 10 + length),
            "loss_mask": torch.ones(length, dtype=torch.long),
            "hidden_states": make_states(length, i),
        }
        name = sample_name(i, "safetensors")
        size, digest = write_atomic(folder, name, encode_parts(sample, "safetensors", LAYERS), algorithm=algorithm)
        manifest.append(Entry(i, name, size, digest, length, algorithm))
    return folder
