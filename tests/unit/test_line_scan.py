"""The row index's bulk read of JSON Lines files (run/line_scan.py): the same rows kept, in the same places, with the
same turns, the same counts and the same errors as reading every row with json.loads and read_chat (the reference
restated here: scan_rows without the bulk reader), over lines written to hit every way a line can differ."""

import gzip
import json

import msgspec
import pytest

from speculators_v016.run import key_table, line_scan, row_shape
from speculators_v016.run.dataset import BadRowError, open_sources, scan_rows
from speculators_v016.run.row_index import build_index
from speculators_v016.run.sources import Duplicates

M = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]


def plain(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a {i}"}]}


def lines() -> list[bytes]:
    """Lines of every kind, each kept, dropped or refused by the reference for its own reason."""
    out = [
        b"\xef\xbb\xbf" + json.dumps({"messages": M}).encode(),  # line 1 with a BOM: read as before, then duplicated
        json.dumps({"messages": M, "id": 7}).encode(),  # its duplicate (other fields are not content)
        b'{"messages":[{"content":"hi","role":"user"},{"role":"assistant","content":"hello \\u0074here"}]}',  # again
        json.dumps({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]}).encode(),
        b"",  # blank
        b"   \t",  # blank
        b"\xc2\xa0",  # a no-break space: blank to str.strip
        json.dumps(plain(1)).encode() + b"\r",  # CRLF
        json.dumps({"messages": []}).encode(),  # empty
        json.dumps({"messages": []}).encode(),  # a duplicate of the empty one
        b'{"messages": [}',  # not JSON
        b'{"messages": [{"role": "user", "content": "x"}], "meta": "\xff"}',  # not UTF-8 in a field not read
        b'{"messages": [{"role": "user", "content": "x"}], "\xfe": 1}',  # not UTF-8 in a key
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate: json.loads reads it
        b'{"messages": [{"role": "user", "content": "\\ud800"}], "x": 1}',  # its duplicate
        b'{"messages": [{"role": "user", "content": "n"}], "x": NaN}',  # NaN: json.loads reads it
        b'{"messages": [{"role": "user", "content": "big"}], "x": 1e400}',
        b'{"messages": [{"role": "user", "content": "deep"}], "x": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        b'{"messages": [{"role": "user", "content": "d450"}], "x": ' + b"[" * 450 + b"]" * 450 + b"}",
        b'{"messages": [{"role": "user", "content": "trail"}]} {}',  # extra data
        json.dumps({"messages": [{"role": "narrator", "content": "n"}]}).encode(),  # a role read later
        json.dumps({"messages": [{"role": "function_call", "content": '{"name": "f", "arguments": {}}'}]}).encode(),
        json.dumps({"messages": [{"role": "function_call", "content": "not json"}]}).encode(),  # bad
        json.dumps({"messages": [{"role": "user", "content": None}]}).encode(),  # bad
        json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(),  # bad
        json.dumps({"messages": [{"role": "user"}]}).encode(),  # bad
        json.dumps({"conversations": [{"from": "human"}]}).encode(),  # bad
        json.dumps({"messages": M, "conversations": None}).encode(),  # bad: conversations is read first
        json.dumps({"messages": M, "conversations": [{"from": "human", "value": "c"}]}).encode(),  # both
        json.dumps({"messages": M, "tools": []}).encode(),  # tools: content differs from line 1's
        json.dumps({"messages": M, "tools": None}).encode(),
        json.dumps({"messages": [{"role": "tool", "content": "r", "tool_call_id": "c1"}]}).encode(),
        json.dumps({"messages": [{**M[0], "weight": 0}]}).encode(),  # a turn key: content
        json.dumps({"messages": [{"role": "x", "content": "hi"}]}).encode(),
        b'{"messages": [{"role": "user", "role": "assistant", "content": "k"}]}',  # a key twice: the last is read
        b'{"messages": [{"role": "assistant", "content": "k"}]}',  # its duplicate
        json.dumps([1, 2]).encode(),  # not an object: bad
        b"3",
        b"  " + json.dumps(plain(2)).encode(),  # leading spaces
        json.dumps(plain(1)).encode(),  # the CRLF line's duplicate
        json.dumps({"messages": [{"role": "User", "content": "\u00e9\u4e2d\U0001f600"}]}, ensure_ascii=False).encode(),
        json.dumps({"messages": [{"role": "User", "content": "\u00e9\u4e2d\U0001f600"}]}).encode(),  # escaped: dup
    ]
    out += [json.dumps(plain(i)).encode() for i in range(3, 40)]
    return out


def write(path, rows: list[bytes], last_newline: bool = True) -> str:
    path.write_bytes(b"\n".join(rows) + (b"\n" if last_newline else b""))
    return str(path)


def reference(paths, skip, keep=False):
    """What scan_rows keeps, every row parsed: [(source, locator, turns)], skipped, per-source skipped."""
    kept = []
    sources = open_sources(paths, None)
    kind, sources, skipped = scan_rows(
        paths,
        skip,
        None,
        lambda n, loc, _w, v: kept.append((n, tuple(loc), len(v[0] if isinstance(v, tuple) else v.turns))),
        opened=sources,
        keep_duplicates=keep,
    )
    return kind, kept, skipped, [dict(s.skipped) for s in sources]


def bulk(paths, skip, keep=False):
    index = build_index(paths, skip, None, keep_duplicates=keep)
    kept = list(
        zip(
            index.source.tolist(),
            zip(index.offset.tolist(), index.number.tolist(), strict=True),
            index.size.tolist(),
            strict=True,
        )
    )
    return index.kind, kept, index.skipped, [dict(s.skipped) for s in index.sources]


def test_every_kind_of_line_is_read_as_json_loads_reads_it(tmp_path, monkeypatch):
    """Bulk and row by row agree on kept rows, places, turns and counts, the rows split across small blocks."""
    data = write(tmp_path / "a.jsonl", lines(), last_newline=False)
    more = write(tmp_path / "b.jsonl", [json.dumps(plain(i)).encode() for i in range(30, 50)] + lines()[:3])
    paths = [data, more, f"{data}#max=20", f"{more}#max=5"]
    expected = reference(paths, True)
    assert expected[2]["bad row"] > 10 and expected[2]["duplicate row"] > 10 and expected[2]["empty conversation"]
    for block in (line_scan.BLOCK, 64, 1 << 12):
        monkeypatch.setattr(line_scan, "BLOCK", block)
        assert bulk(paths, True) == expected
    assert bulk(paths, True, keep=True) == reference(paths, True, keep=True)


@pytest.mark.parametrize("recent", [1, 2, 5])
def test_the_key_tables_levels_changing_within_a_block_drop_the_same_rows(tmp_path, monkeypatch, recent):
    """The duplicate check's table settling every few keys (run/key_table.py), mid-block: the same rows as parsed."""
    monkeypatch.setattr(key_table, "RECENT", recent)
    rows = [json.dumps(plain(i % 7)).encode() for i in range(40)] + lines()
    data = write(tmp_path / "a.jsonl", rows)
    more = write(tmp_path / "b.jsonl", [json.dumps(plain(i)).encode() for i in range(3, 12)] + lines()[:9])
    paths = [data, more, f"{more}#max=4"]
    expected = reference(paths, True)
    assert expected[2]["duplicate row"] > 40
    for block in (64, 1 << 12):
        monkeypatch.setattr(line_scan, "BLOCK", block)
        assert bulk(paths, True) == expected


def test_equal_keys_are_told_apart_by_the_contents_digest(tmp_path, monkeypatch):
    """With every plain row's key equal (hash forced to 0), only rows of equal content are dropped."""
    data = write(tmp_path / "a.jsonl", lines())
    expected = reference([data, data], True)
    monkeypatch.setattr(line_scan, "hash", lambda _row: 0, raising=False)
    monkeypatch.setattr(row_shape, "hash", lambda _row: 0, raising=False)
    assert bulk([data, data], True) == expected


@pytest.mark.parametrize("at", [1, 10, 17, 25])
def test_a_bad_row_is_named_by_file_and_line_as_before(tmp_path, at):
    """Without --skip-bad-rows the first bad row stops the index, with the reference's message (file:line)."""
    rows = [json.dumps(plain(i)).encode() for i in range(30)]
    rows[at - 1] = lines()[{1: 10, 10: 11, 17: 23, 25: 17}[at]]
    data = write(tmp_path / "a.jsonl", rows)
    with pytest.raises(BadRowError) as old:
        reference([data], False)
    with pytest.raises(BadRowError) as new:
        bulk([data], False)
    assert str(new.value) == str(old.value) and f"a.jsonl:{at}:" in str(new.value)


def test_a_final_line_without_newline_and_crlf_lines_keep_their_places(tmp_path):
    """CRLF lines and a last line without a newline: each row read again from its locator is the row written."""
    rows = [json.dumps(plain(i)).encode() + b"\r" for i in range(5)] + [b"", json.dumps(plain(9)).encode()]
    data = write(tmp_path / "a.jsonl", rows, last_newline=False)
    index = build_index([data], False, None)
    assert index.number.tolist() == [1, 2, 3, 4, 5, 7]
    read = [value.turns[0]["value"] for _where, value in index.rows(range(len(index)))]
    assert read == [f"question {i}" for i in (0, 1, 2, 3, 4, 9)]
    assert bulk([data], False) == reference([data], False)


def test_other_inputs_and_mixed_kinds_are_read_as_before(tmp_path):
    """A .json array and a .jsonl.gz beside a plain file share its duplicate check; pre-tokenized rows mix no kind."""
    data = write(tmp_path / "a.jsonl", lines())
    (tmp_path / "b.json").write_text(json.dumps([{"messages": M}, plain(5), plain(77)]))
    with gzip.open(tmp_path / "c.jsonl.gz", "wb") as fh:
        fh.write(b"\n".join([json.dumps(plain(6)).encode(), json.dumps(plain(78)).encode()]))
    paths = [data, str(tmp_path / "b.json"), str(tmp_path / "c.jsonl.gz")]
    assert bulk(paths, True) == reference(paths, True)
    ids = write(tmp_path / "ids.jsonl", [json.dumps({"input_ids": [1, 2], "loss_mask": [0, 1]}).encode()])
    with pytest.raises(BadRowError, match="mix pre-tokenized rows"):
        bulk([data, ids], True)
    both = write(tmp_path / "both.jsonl", [json.dumps({**plain(1), "input_ids": [1], "loss_mask": [1]}).encode()])
    assert bulk([both], False) == reference([both], False) and bulk([both], False)[0] == "pretokenized"


def test_msgspec_accepts_no_json_text_that_json_loads_refuses():
    """The JSON texts where the two parsers might differ: msgspec never accepts one json.loads refuses."""
    texts = [b"01", b"+1", b".5", b"1.", b"[1,]", b"{'a':1}", b'{"a":1,}', b"1e400", b"-0", b'"\\x"', b"tru"]
    texts += [b"[1 2]", b'{"a" 1}', b"\xef\xbb\xbf{}", b"\x0c{}", b"{}\x0c", b"Infinity", b"NaN", b'"\\ud800"']
    texts += [b'{"a":1}\t', b'{"a":1}\r', b" {}", b'"a\x7fb"', b'"\x1f"', b'{"a":1}{}', b'"\\/"', b"1E5", b"[]]"]
    for text in texts:
        try:
            msgspec.json.decode(text)
        except (msgspec.DecodeError, RecursionError):
            continue
        assert json.loads(text.decode("utf-8")) == msgspec.json.decode(text) or text == b"NaN", text


def test_a_plain_rows_key_is_the_same_read_in_bulk_or_parsed():
    """The key of a parsed plain row equals its bulk key; not-plain content has none."""
    line = json.dumps({"messages": M, "id": 1}).encode()
    assert row_shape.key_of(json.loads(line)) == hash(row_shape.DECODER.decode(line))
    assert row_shape.key_of({"messages": M, "tools": []}) is None
    assert row_shape.key_of({"messages": M, "conversations": []}) is None
    assert row_shape.key_of({"messages": [{**M[0], "name": "x"}]}) is None
    duplicates = Duplicates()
    assert not duplicates.seen({"messages": M}) and duplicates.seen({"messages": M, "x": 1})


@pytest.mark.parametrize("block", [1 << 23, 700, 3000])
def test_blocks_of_plain_rows_keep_caps_and_drop_duplicates_as_before(tmp_path, monkeypatch, block):
    """All-plain blocks taken whole: duplicates within a block and across blocks, caps falling inside a block."""
    rows = [json.dumps(plain(i % 37)).encode() for i in range(120)]  # rows 37.. repeat earlier ones
    rows[5] = json.dumps(plain(4)).encode()  # a duplicate in the first block
    data = write(tmp_path / "a.jsonl", rows)
    other = write(tmp_path / "b.jsonl", [json.dumps(plain(i)).encode() for i in range(30, 60)])
    monkeypatch.setattr(line_scan, "BLOCK", block)
    for paths in ([data], [other, data], [f"{data}#max=3", f"{other}#max=11", data], [f"{data}#max=36", other]):
        assert bulk(paths, True) == reference(paths, True)
        assert bulk(paths, True, keep=True) == reference(paths, True, keep=True)


def test_progress_follows_the_bytes_and_a_block_of_empty_rows_is_counted(tmp_path):
    """The progress callback sees bytes grow to the total; a block whose rows are all empty is counted, not taken."""
    empty = write(tmp_path / "empty.jsonl", [json.dumps({"messages": []}).encode()] * 3)
    data = write(tmp_path / "a.jsonl", [json.dumps(plain(i)).encode() for i in range(50)])
    seen = []
    index = build_index([empty, data], False, None, progress=lambda *args: seen.append(args), keep_duplicates=True)
    assert len(index) == 50 and index.skipped == {"empty conversation": 3}
    total = sum((tmp_path / n).stat().st_size for n in ("empty.jsonl", "a.jsonl"))
    assert seen[-1] == (None, 50, total) and seen[-2][0] <= total and seen[-2][1] == 50


@pytest.mark.parametrize("skip", [True, False])
def test_an_int_too_long_for_python_is_a_bad_row_named_by_its_line(tmp_path, skip):
    """A field msgspec skips holding an int past sys.get_int_max_str_digits: a bad row (file:line), as before."""
    rows = [json.dumps(plain(i)).encode() for i in range(6)]
    rows[3] = json.dumps(plain(3)).encode()[:-1] + b', "n": ' + b"7" * 4301 + b"}"
    rows[4] = json.dumps(plain(4)).encode()[:-1] + b', "n": ' + b"7" * 4300 + b", " + b'"s": "' + b"1" * 5000 + b'"}'
    data = write(tmp_path / "a.jsonl", rows)
    if skip:
        assert bulk([data], True) == reference([data], True)
        assert bulk([data], True)[2] == {"bad row": 1} and len(bulk([data], True)[1]) == 5
        return
    for read in (reference, bulk):
        with pytest.raises(BadRowError, match=r"a\.jsonl:4: not valid JSON \(.*4300 digits"):
            read([data], False)


def test_an_int_too_long_for_python_in_a_json_array_is_a_bad_row_named_by_its_index(tmp_path):
    """A .json array whose row holds an int past sys.get_int_max_str_digits: a bad row naming the row, not a crash."""
    rows = [json.dumps(plain(i)) for i in range(4)]
    rows[2] = rows[2][:-1] + ', "n": ' + "7" * 4301 + "}"
    path = tmp_path / "a.json"
    path.write_text("[" + ", ".join(rows) + "]")
    for read in (reference, bulk):
        with pytest.raises(BadRowError, match=r"a\.json row 2: not valid JSON \(.*4300 digits.*the rest of the array"):
            read([str(path)], False)


@pytest.mark.parametrize("equal_keys", [False, True])
def test_a_first_rows_place_is_its_row_index_position_past_empty_rows(tmp_path, monkeypatch, equal_keys):
    """First places are row-index positions: empty rows (not indexed) before them shift none; duplicates still found."""
    rows = [json.dumps(plain(i)).encode() for i in range(8)]
    empty, empty_too = json.dumps({"messages": []}).encode(), json.dumps({"conversations": []}).encode()
    by_line = write(tmp_path / "a.jsonl", [rows[0], empty, rows[1], b"", rows[2]])  # a blank line: row by row
    whole = write(tmp_path / "c.jsonl", [rows[3], empty_too, rows[4], rows[5]])  # new keys: taken whole, else
    again = write(tmp_path / "b.jsonl", [rows[1], rows[2], rows[7], rows[0], empty, rows[4], rows[5], empty_too])
    paths = [by_line, whole, again]
    if equal_keys:  # every key equal: each row's check reads an earlier row at its place, even within a block
        monkeypatch.setattr(line_scan, "hash", lambda _row: 0, raising=False)
        monkeypatch.setattr(row_shape, "hash", lambda _row: 0, raising=False)
    expected = reference(paths, True)
    assert expected[2] == {"empty conversation": 2, "duplicate row": 7}
    assert bulk(paths, True) == expected
    assert [loc[1] for _, loc, _ in expected[1]] == [1, 3, 5, 1, 3, 4, 3]


def test_scan_rows_in_bulk_needs_the_kept_rows_places():
    """take_plain without kept is refused: the duplicate check would have no first places to read."""
    with pytest.raises(ValueError, match="take_plain needs kept"):
        scan_rows([], False, None, lambda *a: None, take_plain=lambda *a: None)
