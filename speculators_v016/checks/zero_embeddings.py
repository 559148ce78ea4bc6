"""The token ids whose input embedding row is all zeros, read once from the checkpoint, without loading the model.

Why the screen needs them (:mod:`~speculators_v016.checks.degenerate`): in a
decoder without biases (Llama, Qwen3, Mistral, DeepSeek, ...), a token whose
embedding row is zero, at position 0, gives exact zeros in every layer:
RMSNorm of 0 is 0, its query, key and value are 0, attention over itself alone
returns its value (0), and the MLP of 0 is 0. So "a row of zeros" is something
such a model really computes, for exactly these tokens (and for a leading run
of them); real checkpoints have such rows (padding and reserved tokens). For
any other token a zero row is still what no model produces: the token's own
non-zero embedding is in the residual stream of every layer.

The rows are read from the checkpoint's safetensors files (the index, or the
one file), the embedding tensor found by its name (``embed_tokens``, ``wte``,
``word_embeddings``, ``tok_embeddings``; the shortest such name where several
hold one, e.g. DeepSeek's MTP layer beside the model's), a block of rows at a
time, so memory stays bounded whatever the vocabulary. None where the
checkpoint has no such tensor there (a hub name, ``.bin`` weights): the screen
then exempts nothing, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "tok_embeddings.weight")
_ROWS = 4096  # rows read at a time


def _embedding_tensor(folder: Path) -> tuple[Path, str] | None:
    """(file, tensor name) of the input embedding in a safetensors checkpoint, or None."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = {name: folder / file for name, file in weight_map.items()}
    else:
        names = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as fh:
                names.update({name: file for name in fh.keys()})  # noqa: SIM118 - safe_open has no __iter__
    found = sorted((n for n in names if n.endswith(NAMES) and "lm_head" not in n), key=lambda n: (len(n), n))
    return (names[found[0]], found[0]) if found else None


def zero_embedding_ids(model_path: str | Path, vocab_size: int) -> frozenset[int] | None:
    """Token ids below ``vocab_size`` whose input embedding row is all zeros; None if it cannot be read here."""
    folder = Path(model_path)
    if not folder.is_dir():
        return None
    where = _embedding_tensor(folder)
    if where is None:
        return None
    file, name = where
    zero: list[int] = []
    with safe_open(str(file), framework="pt") as fh:
        table = fh.get_slice(name)
        shape = table.get_shape()
        if len(shape) != 2:
            return None
        rows = min(int(shape[0]), vocab_size)
        for start in range(0, rows, _ROWS):
            block = table[start : min(start + _ROWS, rows)]
            if block.dtype.is_floating_point and block.element_size() == 1:  # FP8: +0 and -0 codes
                flags = ((block.view(torch.uint8) & 0x7F) == 0).all(dim=1)
            else:
                flags = (block == 0).all(dim=1)
            zero += (torch.nonzero(flags).flatten() + start).tolist()
    return frozenset(zero)
