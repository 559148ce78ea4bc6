"""The resume check: a folder of other settings is refused naming what differs, in the options' own values."""

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from speculators_v016.store import run_config
from speculators_v016.store.run_config import ResumeMismatchError, check_resume


def fingerprint(storage=None) -> dict:
    generation = {"layer_ids": [2, 4], "format": "safetensors", "dtype": "bfloat16"}
    if storage is not None:  # as the pipeline writes it: absent for the default, auto
        generation["hidden_states_dtype"] = storage
    return {"model": {"name": "m"}, "generation": generation}


def save(folder, fp) -> None:
    folder.mkdir(exist_ok=True)
    run_config.save(folder, {"speculators_v016": {"fingerprint": fp}})


def test_a_resume_for_another_storage_names_auto_not_none(tmp_path):
    """FP8 folder resumed with the default storage, and the reverse: the message says 'auto', never None."""
    save(tmp_path, fingerprint("fp8_e4m3"))
    with pytest.raises(ResumeMismatchError) as raised:
        check_resume(tmp_path, fingerprint(), has_samples=True)
    assert "generation.hidden_states_dtype: 'fp8_e4m3' -> 'auto'" in str(raised.value)
    assert "None" not in str(raised.value)
    save(tmp_path, fingerprint())
    with pytest.raises(ResumeMismatchError, match=r"generation.hidden_states_dtype: 'auto' -> 'fp8_e4m3'"):
        check_resume(tmp_path, fingerprint("fp8_e4m3"), has_samples=True)


def test_the_default_storage_resumes_a_folder_of_an_earlier_release(tmp_path):
    """A fingerprint without the field (earlier releases, or auto) matches one that says auto."""
    save(tmp_path, fingerprint())
    assert check_resume(tmp_path, fingerprint("auto"), has_samples=True) is not None
    assert check_resume(tmp_path, fingerprint(), has_samples=True) is not None


# -- the target's weights: a checkpoint replaced in place ---------------------------------------------
def write_model(folder, seed: int = 0, names=("model.embed_tokens.weight", "lm_head.weight"), rows: int = 64) -> Path:
    """A model folder with a real safetensors checkpoint (float32 tensors of ``rows`` x 1024), config and tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    save_file({n: torch.randn(rows, 1024, generator=generator) for n in names}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text('{"num_hidden_layers": 2}')
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "b": 1}}}')
    (folder / "generation_config.json").write_text('{"temperature": 0.6}')
    return folder


def model_fp(folder) -> dict:
    return {"model": run_config.model_fingerprint(str(folder)), "generation": {"layer_ids": [2, 4]}}


def test_a_checkpoint_replaced_in_place_is_refused_naming_the_weights(tmp_path):
    """Other weights under the same names and sizes (another seed): the resume is refused, naming the file."""
    model = write_model(tmp_path / "model")
    save(tmp_path / "out", model_fp(model))
    size = (model / "model.safetensors").stat().st_size
    write_model(model, seed=1)
    assert (model / "model.safetensors").stat().st_size == size
    with pytest.raises(ResumeMismatchError) as raised:
        check_resume(tmp_path / "out", model_fp(model), has_samples=True)
    message = str(raised.value)
    assert "model.weight_digests.model.safetensors: 'sampled-sha256-v1:" in message, message
    assert "the checkpoint was replaced in place (same names and sizes, other weights)" in message, message
    assert "weight_files" not in message  # the sizes are the same: only the digest tells


def test_the_same_checkpoint_resumes(tmp_path):
    """The same files (rewritten byte for byte, new mtimes): the resume is taken."""
    model = write_model(tmp_path / "model")
    save(tmp_path / "out", model_fp(model))
    write_model(model)
    assert check_resume(tmp_path / "out", model_fp(model), has_samples=True) is not None


def test_a_renamed_tensor_is_caught_by_the_header(tmp_path):
    """Same values and sizes, one tensor under another name of the same length: the header digest differs."""
    model = write_model(tmp_path / "model")
    before = run_config.weight_digest(model / "model.safetensors")
    write_model(model, names=("model.embed_tokens.weight", "lm_head.weighx"))
    assert run_config.weight_digest(model / "model.safetensors") != before


def test_a_changed_small_file_is_named(tmp_path):
    """generation_config.json (the --regenerate defaults) edited: named, hashed whole."""
    model = write_model(tmp_path / "model")
    save(tmp_path / "out", model_fp(model))
    (model / "generation_config.json").write_text('{"temperature": 1.0}')
    with pytest.raises(ResumeMismatchError, match=r"model.file_sha256.generation_config.json: '"):
        check_resume(tmp_path / "out", model_fp(model), has_samples=True)


def test_the_sampled_reads_cover_first_last_and_between_and_say_what_they_miss(tmp_path):
    """A weight file larger than its sampled reads: a byte changed in its first, last or a middle chunk is caught; one
    between the chunks is not (the documented limit of sampling: docs/commands/run.md)."""
    model = write_model(tmp_path / "model", rows=2048)  # two tensors of 8 MiB: 16 MiB of data
    path = model / "model.safetensors"
    data_start = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    length = path.stat().st_size - data_start
    offsets = run_config.chunk_offsets(length)
    assert [count for _, count in offsets] == [run_config.CHUNK] * run_config.CHUNKS
    assert offsets[0][0] == 0 and offsets[-1][0] + run_config.CHUNK == length
    original = run_config.weight_digest(path)

    def flipped(position: int) -> str:
        raw = bytearray(path.read_bytes())
        raw[data_start + position] ^= 0xFF
        path.write_bytes(bytes(raw))
        try:
            return run_config.weight_digest(path)
        finally:
            raw[data_start + position] ^= 0xFF
            path.write_bytes(bytes(raw))

    for position in (0, offsets[1][0] + 12345, length - 1):
        assert flipped(position) != original, position
    between = offsets[0][1] + 4096  # after the first chunk, before the second
    assert between < offsets[1][0]
    assert flipped(between) == original  # not caught: outside every sampled chunk
    assert run_config.weight_digest(path) == original


def test_a_600_gb_checkpoint_costs_a_few_reads_per_file():
    """The sampled reads of a 600 GB file: CHUNKS reads of 1 MiB, from its first byte to its last."""
    offsets = run_config.chunk_offsets(600 * 10**9)
    assert len(offsets) == run_config.CHUNKS == 4 and all(count == 1 << 20 for _, count in offsets)
    assert offsets[0][0] == 0 and offsets[-1][0] + (1 << 20) == 600 * 10**9


def test_a_folder_fingerprinted_by_sizes_only_is_refused_saying_why(tmp_path):
    """A folder of an earlier release (weight files by size, no digests): refused, naming the reason."""
    model = write_model(tmp_path / "model")
    old = model_fp(model)
    del old["model"]["weight_digests"], old["model"]["file_sha256"]
    save(tmp_path / "out", old)
    with pytest.raises(ResumeMismatchError) as raised:
        check_resume(tmp_path / "out", model_fp(model), has_samples=True)
    assert "written by an earlier release, whose fingerprint holds the target's weight files by size only" in str(
        raised.value
    )
    assert "Finish the folder with the release that started it, or use another --output-dir" in str(raised.value)


# -- secrets: never written, never compared -----------------------------------------------------------
TOKEN = "hf_" + "Ab1" * 12


def with_engine_args(args: dict) -> dict:
    fp = fingerprint()
    fp["generation"]["engine_args"] = args
    return fp


def test_a_token_is_never_written_and_never_refuses_a_resume(tmp_path):
    """An earlier folder holding hf_token in clear: the resume without it (or with another) is taken, and the
    config saved again holds no token; a message about another difference never shows it."""
    run_config.save(tmp_path, {"speculators_v016": {"fingerprint": with_engine_args({"hf_token": TOKEN})}})
    assert TOKEN.encode() not in (tmp_path / "data_config.json").read_bytes()
    (tmp_path / "data_config.json").write_text(  # as an earlier release wrote it
        json.dumps({"speculators_v016": {"fingerprint": with_engine_args({"hf_token": TOKEN, "block_size": 16})}})
    )
    assert check_resume(tmp_path, with_engine_args({"block_size": 16}), has_samples=True) is not None
    assert check_resume(tmp_path, with_engine_args({"hf_token": "<redacted>", "block_size": 16}), True) is not None
    with pytest.raises(ResumeMismatchError) as raised:
        check_resume(tmp_path, with_engine_args({"block_size": 32}), has_samples=True)
    assert "generation.engine_args.block_size: 16 -> 32" in str(raised.value) and TOKEN not in str(raised.value)


def test_a_tokenizer_named_in_engine_args_edited_in_place_is_named(tmp_path):
    """--engine-args' tokenizer folder with two ids swapped in place: the resume is refused naming the file."""
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "b": 1}}}')
    fp = fingerprint()
    fp["engine_arg_files"] = {"tokenizer": run_config.files_fingerprint(str(tokenizer))}
    save(tmp_path / "out", fp)
    (tokenizer / "tokenizer.json").write_text('{"model": {"vocab": {"a": 1, "b": 0}}}')
    fp["engine_arg_files"] = {"tokenizer": run_config.files_fingerprint(str(tokenizer))}
    with pytest.raises(ResumeMismatchError) as raised:
        check_resume(tmp_path / "out", fp, has_samples=True)
    assert "engine_arg_files.tokenizer.sha256.tokenizer.json: '" in str(raised.value)
    assert "(a file --engine-args names (tokenizer, hf_config_path) changed)" in str(raised.value)
