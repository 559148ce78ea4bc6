"""Dataset inputs: bytes that are not UTF-8 are a bad row (named, skippable), folders and unknown names are
refused, and reading streams: memory for the largest row, not the file."""

import json
import re
import tracemalloc

import pytest

import speculators_v016.run.dataset as dataset
from speculators_v016.run.dataset import BadRowError, load_rows
from speculators_v016.run.prepared import prepare_samples
from speculators_v016.testing.tiny_models import CHAT_TEMPLATE, train_tokenizer


def chat(i: int, words: int = 3) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": f"question {i} " + "word " * words},
            {"from": "gpt", "value": f"answer {i}"},
        ]
    }


def test_non_utf8_line_names_file_and_line_and_can_be_skipped(tmp_path):
    """A JSONL line that is not UTF-8: BadRowError naming file and line; --skip-bad-rows skips and counts it."""
    data = tmp_path / "chats.jsonl"
    data.write_bytes(
        json.dumps(chat(0)).encode() + b"\n" + b'{"conversations": "caf\xe9"}\n' + json.dumps(chat(2)).encode() + b"\n"
    )
    with pytest.raises(BadRowError, match=rf"{data}:2: not UTF-8 text \(byte 22 of the line is b'\\xe9'\)"):
        load_rows([str(data)], skip_bad_rows=False, hf_cache_dir=None)
    kind, rows, _, skipped = load_rows([str(data)], skip_bad_rows=True, hf_cache_dir=None)
    assert [where for where, _ in rows] == [f"{data}:1", f"{data}:3"] and skipped == {"bad row": 1}


def test_non_utf8_element_of_a_json_array_is_a_bad_row(tmp_path):
    """In a .json array, the element holding bytes that are not UTF-8 is the bad row; the others are read."""
    data = tmp_path / "chats.json"
    data.write_bytes(
        b"[" + json.dumps(chat(0)).encode() + b',\n {"conversations": [{"from": "human", "value": '
        b'"caf\xe9"}]},\n' + json.dumps(chat(2)).encode() + b"]"
    )
    with pytest.raises(BadRowError, match=rf"{data} row 1: not UTF-8 text"):
        load_rows([str(data)], skip_bad_rows=False, hf_cache_dir=None)
    _, rows, _, skipped = load_rows([str(data)], skip_bad_rows=True, hf_cache_dir=None)
    assert [chat.turns[0]["value"] for _, chat in rows] == [
        chat(0)["conversations"][0]["value"],
        chat(2)["conversations"][0]["value"],
    ]
    assert skipped == {"bad row": 1}


def test_json_array_rows_across_block_boundaries_read_exactly(tmp_path, monkeypatch):
    """Elements cut by the reading window (values of every JSON kind) are read as json.load reads them."""
    monkeypatch.setattr(dataset, "_CHUNK", 7)
    rows = [
        {"input_ids": [1, 22, 333, 4444], "loss_mask": [0, 1, 1, 1], "x": [True, None, -1.5e3, '\u00e9\\"']},
        {"input_ids": [5], "loss_mask": [1]},
    ] * 5
    data = tmp_path / "tok.json"
    data.write_text("\ufeff [\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n]\n")
    kind, read, _, skipped = load_rows([str(data)], skip_bad_rows=False, hf_cache_dir=None, keep_duplicates=True)
    assert kind == "pretokenized" and not skipped
    assert [ids for _, (ids, _mask) in read] == [r["input_ids"] for r in rows]
    data.write_text("[" + json.dumps(rows[0]) + ", {bad}, " + json.dumps(rows[1]) + "]")
    with pytest.raises(BadRowError, match=rf"{data} row 1: not valid JSON"):
        load_rows([str(data)], skip_bad_rows=True, hf_cache_dir=None)


@pytest.mark.parametrize(
    "given, message",
    [
        ("folder", "a folder holding no *.parquet files and not a datasets save_to_disk folder"),
        ("notes.txt", "not a .json, .jsonl, .jsonl.gz, .jsonl.zst or .parquet file"),
        ("sharegtp", "no such file, and not a dataset name upstream knows (sharegpt, "),
        ("chats.jsonl", "no such file"),
    ],
)
def test_folders_other_files_and_unknown_names_are_bad_input(tmp_path, given, message):
    """An empty folder, a file of another kind, a misspelt dataset name, a missing file: BadRowError naming it
    (exit 3)."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    path = str(tmp_path / given) if given != "sharegtp" else given
    with pytest.raises(BadRowError) as info:
        load_rows([path], skip_bad_rows=True, hf_cache_dir=None)
    assert f"--train-data-path {path}: {message}" in str(info.value)


def test_negative_max_samples_is_refused():
    """max_samples -2 would keep all rows but two: refused before anything is read."""
    with pytest.raises(ValueError, match="max_samples must be at least 1"):
        prepare_samples(["unused.jsonl"], None, 128, max_samples=-2)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_reading_needs_memory_for_a_row_not_the_file(tmp_path, suffix):
    """Peak memory of load_rows beyond the rows it returns stays near the largest row, whatever the file size."""
    rows = [chat(i, words=200) for i in range(6000)]  # ~7 MB
    data = tmp_path / f"big{suffix}"
    lines = [json.dumps(r) for r in rows]
    data.write_text("\n".join(lines) + "\n" if suffix == ".jsonl" else "[" + ",\n".join(lines) + "]")
    largest = max(len(line) for line in lines)
    tracemalloc.start()
    try:
        result = load_rows([str(data)], skip_bad_rows=False, hf_cache_dir=None)
        _, peak = tracemalloc.get_traced_memory()
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(result[1]) == len(rows)
    overhead = peak - kept
    assert overhead < 4 * (1 << 20) + 8 * largest, (overhead, data.stat().st_size)
    assert overhead < data.stat().st_size / 2


def test_a_deeply_nested_line_is_a_bad_row_naming_file_and_line(tmp_path):
    """100,000 nested arrays on line 2: BadRowError naming file:2 (not RecursionError); skipped and counted."""
    data = tmp_path / "chats.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    data.write_text(json.dumps(chat(0)) + "\n" + deep + "\n" + json.dumps(chat(2)) + "\n")
    with pytest.raises(BadRowError, match=rf"^{data}:2: JSON nested too deeply to read"):
        load_rows([str(data)], skip_bad_rows=False, hf_cache_dir=None)
    _, rows, _, skipped = load_rows([str(data)], skip_bad_rows=True, hf_cache_dir=None)
    assert [where for where, _ in rows] == [f"{data}:1", f"{data}:3"] and skipped == {"bad row": 1}


def test_a_deeply_nested_array_element_is_a_bad_row(tmp_path, monkeypatch):
    """In a .json array, an element nested too deeply is a BadRowError naming it (never a RecursionError), and
    --skip-bad-rows skips just that element, strings with brackets and escapes inside it included."""
    monkeypatch.setattr("speculators_v016.run.dataset._CHUNK", 4096)  # the element spans many blocks
    data = tmp_path / "chats.json"
    deep = '{"a": ' + "[" * 50_000 + '"]} \\" ]\\\\", {"b": "[["}' + "]" * 50_000 + "}"
    data.write_text("[" + json.dumps(chat(0)) + ", " + deep + ",\n" + json.dumps(chat(2)) + "]")
    with pytest.raises(BadRowError, match=rf"^{data} row 1: JSON nested too deeply to read"):
        load_rows([str(data)], skip_bad_rows=False, hf_cache_dir=None)
    _, rows, _, skipped = load_rows([str(data)], skip_bad_rows=True, hf_cache_dir=None)
    assert [where for where, _ in rows] == [f"{data} row 0", f"{data} row 2"] and skipped == {"bad row": 1}
    assert rows[1][1].turns[0]["value"] == chat(2)["conversations"][0]["value"]


REJECTING = (
    "{% for message in messages %}{% if message['content'] == 'REJECT ME' %}"
    "{{ raise_exception('this template refuses the row') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def rejecting_tokenizer():
    tok = train_tokenizer(["question answer word " * 20, "REJECT ME"], vocab_size=300)
    assert tok.chat_template == CHAT_TEMPLATE
    tok.chat_template = REJECTING
    return tok


def test_a_row_the_chat_template_rejects_names_file_and_line(tmp_path, rejecting_tokenizer):
    """A row the template rejects (raise_exception) is a BadRowError naming file:line, not a silent drop."""
    data = tmp_path / "chats.jsonl"
    bad = {"conversations": [{"from": "human", "value": "REJECT ME"}, {"from": "gpt", "value": "answer"}]}
    data.write_text("".join(json.dumps(r) + "\n" for r in [chat(0), chat(1), bad, chat(3)]))
    with pytest.raises(BadRowError) as raised:
        prepare_samples([str(data)], rejecting_tokenizer, 64, num_proc=1)
    assert str(raised.value) == (
        f"{data}:3: rejected by the chat template of the target's tokenizer (TemplateError: this template "
        "refuses the row); --skip-bad-rows skips and counts such rows"
    )
    samples = prepare_samples([str(data)], rejecting_tokenizer, 64, num_proc=1, skip_bad_rows=True)
    assert len(samples) == 3 and dict(samples.skipped) == {"bad row": 1}


@pytest.mark.parametrize(
    "tail, text",
    [(b"\n[" + json.dumps(chat(9)).encode() + b"]\n", "'['"), (b" trailing words", "'t'"), (b"]", "']'")],
    ids=["two-arrays-joined", "words", "a-second-bracket"],
)
@pytest.mark.parametrize("empty", [False, True], ids=["rows", "empty-array"])
def test_text_after_a_json_arrays_end_is_refused(tmp_path, tail, text, empty):
    """Anything but whitespace after a .json array's closing ']' (two files joined, a stray word) is an error
    naming the file and the byte it starts at, with --skip-bad-rows too: those rows would never be read (hostile
    review, 2026-12-07); whitespace and a newline after it are fine."""
    body = b"[]" if empty else b"[" + json.dumps(chat(0)).encode() + b", " + json.dumps(chat(1)).encode() + b"]"
    data = tmp_path / "chats.json"
    data.write_bytes(body + tail)
    at = len(body) + len(tail) - len(tail.lstrip())  # the first byte past the whitespace
    for skip in (False, True):
        with pytest.raises(
            BadRowError, match=rf"{data}: text after the JSON array's closing '\]' \(byte {at}: {re.escape(text)}"
        ):
            load_rows([str(data)], skip_bad_rows=skip, hf_cache_dir=None)
    data.write_bytes(body + b" \n\t\n")
    if not empty:
        _, rows, _, skipped = load_rows([str(data)], skip_bad_rows=False, hf_cache_dir=None)
        assert len(rows) == 2 and not skipped


@pytest.mark.parametrize("bad", [-1, 2**31, 2**70], ids=["negative", "past-int32", "huge"])
def test_a_pretokenized_id_outside_the_token_range_is_a_bad_row(tmp_path, bad):
    """An id below 0 or past int32 in a pre-tokenized row is a bad row naming file, line, the id and its position,
    read as the rows are (skippable), not a crash once the run has started (hostile review, 2026-12-07)."""
    good = {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [good, {"input_ids": [5, bad, 7], "loss_mask": [0, 1, 1]}]))
    with pytest.raises(BadRowError, match=rf"{data}:2: 'input_ids' holds {bad} at position 1, not a token id"):
        load_rows([str(data)], skip_bad_rows=False, hf_cache_dir=None)
    _, rows, _, skipped = load_rows([str(data)], skip_bad_rows=True, hf_cache_dir=None)
    assert [where for where, _ in rows] == [f"{data}:1"] and skipped == {"bad row": 1}
