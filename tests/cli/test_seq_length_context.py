"""--seq-length equal to the model's context (the usual choice) is refused before anything runs, naming what fits."""

from helpers.cli import conversations, invoke, write_jsonl


def test_seq_length_equal_to_the_context_is_named_with_what_fits(model_dir, tmp_path):
    """The tiny Llama's context is 4096: --seq-length 4096 exits 3 naming --seq-length 4095; nothing written."""
    out = tmp_path / "out"
    result = invoke("--target-model-path", model_dir, "--train-data-path",
                    write_jsonl(tmp_path / "chats.jsonl", conversations(4)), "--output-dir", out,
                    "--seq-length", 4096, "--token-freq-path", "")  # fmt: skip
    assert result.exit_code == 3, result.output[-3000:]
    assert "error: --seq-length 4096 does not fit the model's context" in result.output
    assert "Give --seq-length 4095 or less" in result.output
    assert not list(out.glob("data_*"))


def test_seq_length_is_judged_before_any_row_is_read(model_dir, tmp_path):
    """A --seq-length past the context is refused before the dataset is read: a broken first row is never reached."""
    data = tmp_path / "broken.jsonl"
    data.write_text("{not json\n")
    out = tmp_path / "out"
    result = invoke("--target-model-path", model_dir, "--train-data-path", data, "--output-dir", out,
                    "--seq-length", 8192, "--token-freq-path", "")  # fmt: skip
    assert result.exit_code == 3, result.output[-3000:]
    assert "error: --seq-length 8192 does not fit the model's context" in result.output, result.output[-3000:]
    assert "broken.jsonl" not in result.output
