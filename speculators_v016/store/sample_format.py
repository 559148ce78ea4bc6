"""One training sample on disk: safetensors (default) or upstream's ``.pt`` layout.

A sample is ``input_ids`` (int64 ``[T]``), ``loss_mask`` (int64 ``[T]``, 1 on
trainable tokens) and one ``[T, hidden]`` tensor per captured layer, in the
order of ``data_config.json``'s ``layer_ids``.

* ``safetensors``: keys ``input_ids``, ``loss_mask``, ``hidden_states.0`` ...
  ``hidden_states.{k-1}``; the header's metadata names the format and layer
  ids. The header is padded with spaces (as the format allows) so the data
  starts at a multiple of :data:`DATA_ALIGN`, and the states come first
  (then FP8 scales, ``input_ids``, ``loss_mask``), each where the one before
  it ends: memory that holds each tensor at an address equal to its offset in
  the data modulo :data:`DATA_ALIGN` (the CLI's buffer pool places them so) is
  written to the disk from where it lies (:mod:`~speculators_v016.store.direct_io`).
  Loading never unpickles anything. With FP8 storage
  (``--hidden-states-dtype fp8_e4m3``) ``hidden_states.{j}`` holds e4m3 codes
  (``F8_E4M3`` ``[T, hidden]``) and ``hidden_states_scale.{j}`` one float32
  scale per token (``F32`` ``[T]``); the metadata says ``hidden_states_dtype``
  and ``hidden_states_scaling``. :func:`load_sample` dequantizes them.
* ``pt``: upstream 0.3.0's exact ``torch.save`` dict ``{"input_ids",
  "hidden_states": [tensor per layer], "loss_mask"}``, for stock trainers;
  we read it only with ``torch.load(weights_only=True)``. Never FP8: upstream's
  ``.pt`` readers would take the codes for values.

File names come from the sample index alone: ``data_{index}.{ext}``.
"""

from __future__ import annotations

import io
import json
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from speculators_v016 import fp8
from speculators_v016.fp8 import Fp8States
from speculators_v016.store.direct_io import ALIGN as DATA_ALIGN

FORMATS = {"safetensors": ".safetensors", "pt": ".pt"}
FORMAT_TAG = "speculators-v016/sample-v1"
_NAME = re.compile(r"^data_(\d+)\.(safetensors|pt)$")


def sample_name(index: int, fmt: str) -> str:
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"a sample index must be a non-negative int, got {index!r}")
    return f"data_{index}{FORMATS[fmt]}"


def parse_sample_name(name: str) -> tuple[int, str] | None:
    """(index, format) for a sample file name, None for anything else."""
    match = _NAME.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


_SAFETENSORS_DTYPES = {
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
}
SCALE_KEY = "hidden_states_scale.{}"


def _raw(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying them."""
    return memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def safetensors_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list:
    """A safetensors file as ``[header, tensor bytes...]``: the tensors' own memory, never joined.

    The layout is the format's: 8-byte little-endian header length, the JSON
    header (padded with spaces so the data starts at a multiple of
    :data:`DATA_ALIGN`), then each tensor's data in header order.
    """
    header: dict = {"__metadata__": metadata}
    buffers, offset = [], 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype} has no safetensors name")
        raw = _raw(tensor)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + raw.nbytes],
        }
        offset += raw.nbytes
        buffers.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DATA_ALIGN)
    return [struct.pack("<Q", len(text)) + text, *buffers]


#: The header field naming the engine arguments that changed the model (``data_config.json``'s
#: ``speculators_v016.model_changing_engine_args``, as compact JSON); absent where none did.
MODEL_ARGS_KEY = "model_changing_engine_args"


def header_metadata(layer_ids: list[int], quantized: bool, model_args: dict | None = None) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors sample file, exactly as written (``model_args``: the engine
    arguments that changed the model, secrets already redacted)."""
    metadata = {"format": FORMAT_TAG, "layer_ids": ",".join(map(str, layer_ids))}
    if quantized:
        metadata.update(hidden_states_dtype=fp8.NAME, hidden_states_scaling=fp8.SCALING)
    if model_args:
        metadata[MODEL_ARGS_KEY] = json.dumps(model_args, sort_keys=True, separators=(",", ":"))
    return metadata


def read_header_metadata(path: str | Path) -> dict:
    """The ``__metadata__`` of a safetensors file ({} without one), read from its header alone."""
    with safe_open(str(path), framework="pt") as fh:
        return dict(fh.metadata() or {})


def encode_parts(sample: dict, fmt: str, layer_ids: list[int], model_args: dict | None = None) -> list:
    """The file contents of one sample, as buffers to write in order.

    ``sample["hidden_states"]`` holds one tensor per layer, or one
    :class:`~speculators_v016.fp8.Fp8States` per layer (safetensors only).
    ``model_args``: see :func:`header_metadata`.
    """
    return encode_typed(sample, fmt, layer_ids, model_args)[0]


def encode_typed(
    sample: dict, fmt: str, layer_ids: list[int], model_args: dict | None = None
) -> tuple[list, list | None]:
    """:func:`encode_parts`, and the dtype of each buffer's elements (None for the header).

    The dtypes are None as a whole for ``.pt``: its one buffer is pickled, its
    tensors' bytes cannot be told apart there.
    """
    states = sample["hidden_states"]
    quantized = [isinstance(h, Fp8States) for h in states]
    if any(quantized) and not all(quantized):
        raise ValueError("a sample mixes FP8 and unquantized layers")
    if fmt == "safetensors":
        metadata = header_metadata(layer_ids, bool(quantized) and all(quantized), model_args)
        # the states first, in the order of the engine's memory for them (buffer_pool): codes, then scales
        if quantized and all(quantized):
            tensors = {f"hidden_states.{j}": h.codes for j, h in enumerate(states)}
            tensors.update({SCALE_KEY.format(j): h.scales for j, h in enumerate(states)})
        else:
            tensors = {f"hidden_states.{j}": h for j, h in enumerate(states)}
        tensors.update({"input_ids": sample["input_ids"], "loss_mask": sample["loss_mask"]})
        return safetensors_parts(tensors, metadata), [None, *(t.dtype for t in tensors.values())]
    if fmt == "pt":
        if any(quantized):
            raise ValueError(
                "FP8 hidden states cannot be stored as .pt: upstream's readers would take the "
                "codes for values; use safetensors"
            )
        buffer = io.BytesIO()
        torch.save(
            {
                "input_ids": sample["input_ids"],
                "hidden_states": [h.contiguous() for h in sample["hidden_states"]],
                "loss_mask": sample["loss_mask"],
            },
            buffer,
        )
        return [buffer.getbuffer()], None
    raise ValueError(f"unknown sample format {fmt!r}; choose from {sorted(FORMATS)}")


def read_input_ids(path: str | Path) -> list[int]:
    """A sample file's ``input_ids`` alone (safetensors: that tensor only; ``.pt``: memory-mapped, ``weights_only``)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor("input_ids").tolist()
    data = load_sample(path)
    return data["input_ids"].tolist()


def load_sample(path: str | Path, dequantize_to: torch.dtype | None = torch.float32) -> dict:
    """Read a sample file (either format) into upstream's dict layout, without unpickling code.

    FP8 states (codes + scales) come back dequantized to ``dequantize_to``
    (float32 by default: what upstream's trainer reads states as), or, with
    ``dequantize_to=None``, as :class:`~speculators_v016.fp8.Fp8States`.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        tensors = load_file(str(path))
        count = sum(1 for k in tensors if k.startswith("hidden_states."))
        scales = sum(1 for k in tensors if k.startswith("hidden_states_scale."))
        missing = {"input_ids", "loss_mask", *(f"hidden_states.{j}" for j in range(count))} - set(tensors)
        if scales:
            missing |= {SCALE_KEY.format(j) for j in range(count)} - set(tensors)
        if missing:
            raise ValueError(f"{path}: missing tensors {sorted(missing)}")
        states = [tensors[f"hidden_states.{j}"] for j in range(count)]
        if scales or any(h.dtype == fp8.CODE_DTYPE for h in states):
            states = _fp8_states(
                path, states, [tensors.get(SCALE_KEY.format(j)) for j in range(count)], scales, dequantize_to
            )
        return {"input_ids": tensors["input_ids"], "loss_mask": tensors["loss_mask"], "hidden_states": states}
    if path.suffix == ".pt":
        data = torch.load(path, weights_only=True, map_location="cpu", mmap=True)
        if not isinstance(data, dict) or not {"input_ids", "hidden_states", "loss_mask"} <= set(data):
            raise ValueError(f"{path}: not a speculators sample (expected input_ids, hidden_states, loss_mask)")
        return data
    raise ValueError(f"{path}: not a sample file (.safetensors or .pt)")


def _fp8_states(path: Path, codes: list, scales: list, count: int, dequantize_to: torch.dtype | None) -> list:
    """Codes and scales of an FP8 file, checked to belong together; dequantized unless ``dequantize_to`` is None."""
    if count != len(codes) or any(c.dtype != fp8.CODE_DTYPE for c in codes):
        raise ValueError(
            f"{path}: FP8 file with {len(codes)} hidden_states ({sorted({str(c.dtype) for c in codes})}) "
            f"and {count} hidden_states_scale tensors: codes must be float8_e4m3fn, one scale "
            "tensor per layer"
        )
    states = [Fp8States(c, s) for c, s in zip(codes, scales)]
    for j, state in enumerate(states):
        if state.scales.dtype != fp8.SCALE_DTYPE or tuple(state.scales.shape) != tuple(state.codes.shape[:1]):
            raise ValueError(
                f"{path}: hidden_states_scale.{j} is {tuple(state.scales.shape)} "
                f"{state.scales.dtype}, expected [{state.codes.shape[0]}] float32"
            )
    return states if dequantize_to is None else [s.dequantize(dequantize_to) for s in states]
