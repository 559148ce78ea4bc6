"""Datasets at a draft's scale (issue 52): a shard tokenizes its own rows only, named by their position in the
run's order; samples in numpy arrays; tokenized rows cached, checked and rebuilt; earlier folders' numbering
refused where it could differ. The old path (every row loaded and tokenized) is restated here as the reference."""

import json
import random
from pathlib import Path

import numpy as np
import pytest

from speculators_v016.run import chat_samples, dataset, prefill, prepared
from speculators_v016.run.dataset import load_rows, run_order, shuffled
from speculators_v016.run.prefill import PrefillWork, check_numbering
from speculators_v016.run.prepared import Options, plan_run, prepare_samples
from speculators_v016.run.row_index import build_index
from speculators_v016.store import prepared_cache
from speculators_v016.store.no_links import LinkedEntryError
from speculators_v016.store.run_config import ResumeMismatchError
from speculators_v016.testing.tiny_models import DEFAULT_CORPUS, train_tokenizer

WORDS = "the quick brown fox jumps over a lazy dog and then sleeps in the warm sun all day".split()


@pytest.fixture(scope="module")
def tok():
    """The demo's tokenizer (the tiny models' corpus and ChatML template)."""
    return train_tokenizer(DEFAULT_CORPUS, 512)


def chats(count: int, seed: int, drops: bool = False) -> list[dict]:
    """Conversations of 1-3 exchanges; with ``drops`` every fifth has no answer within 40 tokens or none at all."""
    draw = random.Random(seed)
    rows = []
    for i in range(count):
        turns = []
        for _ in range(draw.randint(1, 3)):
            turns.append({"from": "human", "value": " ".join(draw.choices(WORDS, k=draw.randint(2, 8)))})
            turns.append({"from": "gpt", "value": " ".join(draw.choices(WORDS, k=draw.randint(2, 8)))})
        if drops and i % 5 == 2:
            turns = [{"from": "human", "value": f"question {i}, which nobody answers"}]  # distinct: no duplicate
        elif drops and i % 5 == 4:
            turns[0]["value"] = " ".join(WORDS * 6)  # the answer starts past --seq-length 40
        rows.append({"conversations": turns})
    return rows


def write(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def old_path(paths, tok, seq, *, seed=0, max_samples=None, turn_dropout=False):
    """Main's prepare_samples, restated: every row loaded, ordered, every picked row tokenized, kept samples."""
    kind, rows, _, _ = load_rows(paths, False, None)
    picked = [rows[i] for i in run_order(len(rows), seed, max_samples)]
    if kind == "pretokenized":
        out = [(ids[:seq], mask[:seq]) for _, (ids, mask) in picked]
    else:
        settings = chat_samples.Settings.of(tok, seq)
        random.seed(seed)
        keeps = [random.randint(1, len(chat.turns)) if turn_dropout else None for _, chat in picked]
        built = chat_samples.build_all(picked, keeps, tok, settings, 1)
        out = [(b.ids, b.mask) for b in built if b.ids is not None]
    return [(list(ids), list(mask)) for ids, mask in out if any(mask)]


def as_pairs(samples) -> list:
    return list(zip(samples.input_ids, samples.loss_masks, strict=True))


def test_the_order_is_datasets_shuffle():
    """The run's order is datasets' shuffle of the row numbers with the seed, for any count and seed."""
    import datasets  # noqa: PLC0415 - slow to import; this test alone needs it

    for count, seed in ((1, 0), (7, 3), (1000, 0), (4099, 12345)):
        want = datasets.Dataset.from_dict({"i": list(range(count))}).shuffle(seed=seed)["i"]
        assert shuffled(count, seed).tolist() == list(want)
    assert run_order(10, 1, 4).tolist() == shuffled(10, 1)[:4].tolist()


@pytest.mark.parametrize("turn_dropout", [False, True])
def test_samples_are_the_old_paths_plain_and_sharded(tmp_path, tok, turn_dropout):
    """Without rows dropped after tokenizing, a shard's samples, names and shard are the old path's exactly."""
    data = write(tmp_path / "d.jsonl", chats(40, seed=1))
    old = old_path([data], tok, 4096, seed=3, turn_dropout=turn_dropout)
    assert len(old) == 40
    for shards in (1, 3):
        for index in range(shards):
            new = prepare_samples(
                [data], tok, 4096, seed=3, num_proc=1, turn_dropout=turn_dropout, num_shards=shards, shard_index=index
            )
            assert new.names.tolist() == list(range(index, 40, shards))
            assert as_pairs(new) == [old[i] for i in range(index, 40, shards)]


def test_dropped_rows_leave_gaps_in_the_names(tmp_path, tok):
    """Rows dropped after tokenizing keep their positions: the samples are the old path's, named with gaps."""
    data = write(tmp_path / "d.jsonl", chats(50, seed=2, drops=True))
    old = old_path([data], tok, 40, seed=0)
    new = prepare_samples([data], tok, 40, num_proc=1)
    assert as_pairs(new) == old and len(old) < 50
    assert new.names.tolist() == sorted(new.names.tolist()) and new.names[-1] >= len(old)
    assert new.skipped == {chat_samples.NO_ASSISTANT: 50 - len(old)}
    shard = prepare_samples([data], tok, 40, num_proc=1, num_shards=4, shard_index=1)
    assert all(n % 4 == 1 for n in shard.names)
    assert as_pairs(shard) == [pair for name, pair in zip(new.names, as_pairs(new), strict=True) if name % 4 == 1]


def test_pretokenized_rows_are_the_old_paths(tmp_path, tok):
    """Pre-tokenized rows: cut to seq_length, those without a trained token dropped (a gap), ids as given."""
    draw = random.Random(4)
    rows = []
    for i in range(30):
        n = draw.randint(1, 60)
        mask = [0] * n if i % 7 == 3 else [draw.randint(0, 1) for _ in range(n - 1)] + [1]
        rows.append({"input_ids": [draw.randint(0, 2**31) for _ in range(n)], "loss_mask": mask})
    data = write(tmp_path / "p.jsonl", rows)
    new = prepare_samples([data], None, 32, num_proc=1, seed=5)
    assert as_pairs(new) == old_path([data], None, 32, seed=5)
    assert new.kind == "pretokenized" and new.truncated == sum(
        len(r["input_ids"]) > 32 for r in rows if 1 in r["loss_mask"][:32]
    )


def test_prepared_samples_are_numpy_arrays(tmp_path, tok):
    """The samples are held in compact numpy arrays (uint32 ids, uint8 masks, int64 offsets), no lists of ints."""
    samples = prepare_samples([write(tmp_path / "d.jsonl", chats(20, seed=5))], tok, 4096, num_proc=1)
    assert samples.ids.dtype == np.uint32 and samples.masks.dtype == np.uint8 and samples.offsets.dtype == np.int64
    assert len(samples.ids) == samples.offsets[-1] == len(samples.masks) and len(samples.offsets) == len(samples) + 1
    assert not any(isinstance(v, list) for v in vars(samples).values() if v is not samples.sources)
    edge = write(tmp_path / "w.jsonl", [{"input_ids": [0, 2**31 - 1], "loss_mask": [1, 1]}])
    # kept for the vocabulary check (ids below 0 or past int32 are bad rows as they are read: test_dataset_input)
    assert prepare_samples([edge], None, 8, num_proc=1).ids.tolist() == [0, 2**31 - 1]


def test_a_resumed_shard_feeds_its_pending_rows_only(tmp_path, tok):
    """A resume's feed: the pending samples of the shard, ids and masks as a whole run's; gaps counted as dropped."""
    data = write(tmp_path / "d.jsonl", chats(60, seed=6, drops=True))
    whole = prepare_samples([data], tok, 40, num_proc=1, num_shards=2, shard_index=1)
    by_name = dict(zip(whole.names.tolist(), as_pairs(whole), strict=True))
    plan = plan_run([data], tok, Options(40, num_proc=1))
    work = PrefillWork(plan, 2, 1)
    mine = work.shard(2, 1)
    pending = mine[len(mine) // 2 :]
    try:
        assert work.begin(pending)
        fed = {}
        for name, ids in work.feed(pending):
            mask, _, _ = work.finish(name, ids, None)
            fed[name] = (ids, mask.tolist())
    finally:
        work.close()
    assert fed == {n: by_name[n] for n in pending if n in by_name}
    assert work.dropped == len([n for n in pending if n not in by_name]) > 0


def test_the_order_takes_four_bytes_a_row_where_row_numbers_fit(monkeypatch):
    """The run's order is int32 (datasets' shuffle, the same values) while every row number fits, else int64; a cut
    order holds its own rows only (no view of the whole shuffle)."""
    order = run_order(1000, 3, None)
    assert order.dtype == np.int32 and order.tolist() == shuffled(1000, 3).tolist()
    cut = run_order(1000, 3, 10)
    assert cut.dtype == np.int32 and cut.base is None and cut.tolist() == shuffled(1000, 3)[:10].tolist()
    monkeypatch.setattr(dataset, "shuffled", lambda count, seed: np.arange(3, dtype=np.int64))
    assert run_order(2**31, 0, None).dtype == np.int32 and run_order(2**31 + 1, 0, None).dtype == np.int64


def test_pending_positions_are_an_int64_array_without_the_done_names():
    """A shard's pending positions: those whose names (start_idx + position) are neither done nor settled, in order;
    nothing done: the shard's own array, not a copy."""
    from speculators_v016.run.pipeline import pending_positions  # noqa: PLC0415 - the pipeline imports the engine

    mine = np.arange(1, 40, 3, dtype=np.int64)
    assert pending_positions(mine, 100, {}, set()) is mine
    got = pending_positions(mine, 100, {104: "entry", 110: "entry", 999: "another shard's"}, {119})
    assert got.dtype == np.int64 and got.tolist() == [1, 7, 13, 16, 22, 25, 28, 31, 34, 37]
    assert pending_positions(mine, 0, dict.fromkeys(mine.tolist()), set()).tolist() == []


def test_begin_tokenizes_the_chunks_holding_pending_rows_given_in_any_order(tmp_path):
    """The shard's positions are an int64 array; begin() keeps ascending pending positions as given (no copy) and
    sorts others; only the chunks holding a pending row are tokenized, and those rows fed in order."""
    rows = [{"input_ids": [i % 50, 1, 2], "loss_mask": [0, 1, 1]} for i in range(1200)]
    data = write(tmp_path / "p.jsonl", rows)
    work = PrefillWork(plan_run([data], None, Options(16, num_proc=1, keep_duplicates=True)))
    try:
        mine = work.shard(1, 0)
        assert mine.dtype == np.int64 and mine.tolist() == list(range(1200))
        pending = np.array([1100, 3, 1050], np.int64)
        assert work.begin(pending) and work._stream.want == [0, 2]
        assert [name for name, _ in work.feed(pending)] == [3, 1050, 1100]
    finally:
        work.close()
    again = PrefillWork(plan_run([data], None, Options(16, num_proc=1, keep_duplicates=True)), 2, 1)
    try:
        ascending = again.shard(2, 1)[300:]
        assert again.begin(ascending) and again._pending is ascending and again._stream.want == [0, 1]
    finally:
        again.close()


def test_every_pending_row_dropped_is_said_before_the_engine(tmp_path, tok):
    """A shard whose pending rows are all dropped after tokenizing: begin() says no sample will come."""
    rows = [{"conversations": [{"from": "human", "value": f"question {i}, which nobody answers"}]} for i in range(3)]
    plan = plan_run([write(tmp_path / "d.jsonl", rows)], tok, Options(64, num_proc=1))
    work = PrefillWork(plan)
    try:
        assert not work.begin(work.shard(1, 0))
        work.settle()
    finally:
        work.close()
    assert work.dropped == 3 and work.skipped == {chat_samples.NO_ASSISTANT: 3}


def counting(monkeypatch) -> list:
    calls = []
    original = chat_samples.build_row

    def build_row(*args, **kwargs):
        calls.append(args[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(chat_samples, "build_row", build_row)
    return calls


def test_a_second_run_tokenizes_nothing_and_a_change_tokenizes_again(tmp_path, tok, monkeypatch):
    """With the cache, a second preparation tokenizes no row; one changed byte of the input, or another
    --seq-length, tokenizes again; what comes out is always what tokenizing gives."""
    calls = counting(monkeypatch)
    cache = tmp_path / "cache"
    data = Path(write(tmp_path / "d.jsonl", chats(30, seed=7, drops=True)))

    def tokenized(seq: int) -> tuple:
        before = len(calls)
        samples = prepare_samples([str(data)], tok, seq, num_proc=1, cache=cache)
        return samples, len(calls) - before

    first, rows = tokenized(40)
    assert rows == 30 and prepared_cache.folder_size(cache)[0] == 2  # the row index, one chunk
    again, rows = tokenized(40)
    assert rows == 0 and as_pairs(again) == as_pairs(first) and again.names.tolist() == first.names.tolist()
    assert again.skipped == first.skipped
    other, rows = tokenized(48)
    assert rows == 30 and as_pairs(other) == old_path([str(data)], tok, 48)
    data.write_bytes(data.read_bytes().replace(b"quick", b"quack", 1))
    changed, rows = tokenized(40)
    assert rows == 30 and as_pairs(changed) == old_path([str(data)], tok, 40) != as_pairs(first)


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_cache_entry_is_rebuilt_never_used(tmp_path, tok, monkeypatch, damage):
    """An entry with a changed byte, cut short or with a broken header is detected, tokenized again and
    rewritten; the samples are those tokenizing gives."""
    cache = tmp_path / "cache"
    data = write(tmp_path / "d.jsonl", chats(20, seed=8))
    want = as_pairs(prepare_samples([data], tok, 4096, num_proc=1, cache=cache))
    for entry in sorted(cache.glob("*.prep")):
        raw = bytearray(entry.read_bytes())
        if damage == "flip":
            raw[-1] ^= 0x01
        elif damage == "truncate":
            raw = raw[: len(raw) - 5]
        else:
            at = raw.index(b'"payload_bytes"')
            raw[at : at + 3] = b"xxx"
        entry.write_bytes(bytes(raw))
        with pytest.raises(prepared_cache.CorruptEntry, match=str(entry)):
            prepared_cache.read_entry(cache, entry.name)
    calls = counting(monkeypatch)
    assert as_pairs(prepare_samples([data], tok, 4096, num_proc=1, cache=cache)) == want
    assert len(calls) == 20
    for entry in cache.glob("*.prep"):
        assert prepared_cache.read_entry(cache, entry.name) is not None  # rebuilt whole


def test_cache_entries_are_ours_only(tmp_path):
    """Entry names are hex digests; an entry that is a link is refused unread; no object dtype is written."""
    name = prepared_cache.entry_name("key")
    assert len(name) == 64 + len(".prep") and all(c in "0123456789abcdef" for c in name[:64])
    with pytest.raises(ValueError, match="not a cache entry name"):
        prepared_cache.read_entry(tmp_path, "../x.prep")
    with pytest.raises(ValueError, match="dtype object"):
        prepared_cache.write_entry(tmp_path, name, {"a": np.array([None], dtype=object)}, {})
    prepared_cache.write_entry(
        tmp_path, name, {"a": np.arange(5, dtype=np.int64), "e": np.zeros(0, np.uint8)}, {"k": 1}
    )
    arrays, facts = prepared_cache.read_entry(tmp_path, name)
    assert arrays["a"].tolist() == [0, 1, 2, 3, 4] and len(arrays["e"]) == 0 and facts == {"k": 1}
    other = prepared_cache.entry_name("other")
    (tmp_path / other).symlink_to(tmp_path / name)
    with pytest.raises(LinkedEntryError):
        prepared_cache.read_entry(tmp_path, other)


def test_rows_are_read_again_by_their_place_in_the_file(tmp_path, monkeypatch):
    """A .json array (multibyte text, a BOM, rows across the 1 MiB window) and a JSON Lines file: each row
    read again by its locator is the row read in the stream."""
    import speculators_v016.run.dataset as dataset  # noqa: PLC0415 - its window shrunk for this test

    monkeypatch.setattr(dataset, "_CHUNK", 64)
    rows = [
        {"conversations": [{"from": "human", "value": "é" * i + "ü"}, {"from": "gpt", "value": "日本" * i}]}
        for i in range(40)
    ]
    array = tmp_path / "a.json"
    array.write_bytes(
        b"\xef\xbb\xbf [\n" + ",\n  ".join(json.dumps(r, ensure_ascii=False) for r in rows).encode() + b"]"
    )
    lines = tmp_path / "l.jsonl"
    lines.write_bytes(b"\xef\xbb\xbf" + b"\n\n".join(json.dumps(r, ensure_ascii=False).encode() for r in rows))
    for path in (array, lines):
        _, streamed, _, _ = load_rows([str(path)], False, None)
        index = build_index([str(path)], False, None)
        try:
            again = [index.row(i) for i in range(len(index))]
        finally:
            index.close()
        assert [(w, c.turns) for w, c in again] == [(w, c.turns) for w, c in streamed]
        assert index.size.tolist() == [2] * 40


def test_the_row_index_takes_the_narrowest_dtypes_its_values_fit(tmp_path, tok):
    """A few inputs of short conversations: source and size one byte a row, line int32, offset int64 (14 bytes);
    a row of 300 turns widens its column, the values whole; the index cached and read back the same."""
    data = write(tmp_path / "d.jsonl", chats(30, seed=2))
    index = build_index([data, data], False, None, keep_duplicates=True)
    dtypes = [a.dtype for a in (index.source, index.offset, index.number, index.size)]
    assert dtypes == [np.uint8, np.int64, np.int32, np.uint8] and index.source.tolist() == [0] * 30 + [1] * 30
    long = [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}] * 150}]
    wide = build_index([write(tmp_path / "w.jsonl", chats(3, seed=2) + long)], False, None, cache=tmp_path / "c")
    assert wide.size.dtype == np.int32 and wide.size.tolist()[-1] == 300
    again = build_index([str(tmp_path / "w.jsonl")], False, None, cache=tmp_path / "c")
    assert again.size.dtype == np.int32 and again.size.tolist() == wide.size.tolist()


def test_a_changed_input_is_refused_when_read_again(tmp_path, tok):
    """An input changed after it was indexed is refused by name when a row is read again, never read."""
    data = Path(write(tmp_path / "d.jsonl", chats(10, seed=9)))
    plan = plan_run([str(data)], tok, Options(64, num_proc=1))
    data.write_text(data.read_text().replace("fox", "cat"))
    try:
        with pytest.raises(prepared.BadRowError, match=f"{data}: changed since the run read it"):
            plan.chunk(1, 0, 0)
    finally:
        plan.close()


def test_an_earlier_folders_numbering_is_refused_where_it_could_differ(tmp_path):
    """A folder without the numbering field resumes only where it counted every row of the run's order as a
    sample; otherwise, or with another numbering, the resume is refused naming the folder and what to do."""
    old = {"speculators_v016": {"dataset_samples": 48}}
    check_numbering(tmp_path, {"speculators_v016": {"numbering": prefill.NUMBERING}}, 50)
    check_numbering(tmp_path, {"speculators_v016": {"dataset_samples": 50}}, 50)  # no row was dropped: same names
    with pytest.raises(ResumeMismatchError) as refused:
        check_numbering(tmp_path, old, 50)
    message = str(refused.value)
    assert f"{tmp_path}/data_config.json was written by an earlier release" in message
    assert "(48 of the 50 rows" in message and "use another --output-dir" in message
    with pytest.raises(ResumeMismatchError, match="numbers its samples as 'kept-samples'"):
        check_numbering(tmp_path, {"speculators_v016": {"numbering": "kept-samples"}}, 50)


def test_a_long_shard_streams_chunk_by_chunk_and_counts_its_tokens(tmp_path):
    """More rows than a chunk: the engine may start after the first chunk (tokens then estimated); the feed gives
    every sample as prepare_samples does; the trained tokens are counted over all of them."""
    draw = random.Random(11)
    rows = []
    for i in range(1200):
        n = draw.randint(2, 20)
        rows.append({"input_ids": [draw.randint(0, 99) for _ in range(n)], "loss_mask": [int(i % 9 != 0)] * n})
    data = write(tmp_path / "p.jsonl", rows)
    whole = prepare_samples([data], None, 16, num_proc=1)
    work = PrefillWork(plan_run([data], None, Options(16, num_proc=1)), token_counts=True)
    pending = work.shard(1, 0)
    try:
        assert work.begin(pending) and work.tokens(pending) is None
        estimate, rows_seen = work.estimated_tokens(pending)
        assert rows_seen == prepared.CHUNK_ROWS and 0.8 < estimate / len(whole.ids) < 1.2
        fed = [(ids, work.finish(name, ids, None)[0].tolist()) for name, ids in work.feed(pending)]
    finally:
        work.close()
    assert fed == as_pairs(whole) and work.dropped == 1200 - len(whole)
    want = {}
    for ids, mask in fed:
        for t, m in zip(ids, mask, strict=True):
            want[t] = want.get(t, 0) + m
    assert dict(work.token_counts) == {t: n for t, n in want.items() if n}


def test_a_regenerating_shard_keeps_only_its_own_conversations_text(tmp_path):
    """--regenerate's plan read one row at a time from the index: the same sample indices for every conversation;
    only the shard's keep their turns, the others their facts (answers, unanswered turns, tools)."""
    from speculators_v016.run.regenerate import plan  # noqa: PLC0415 - regenerate imports the engine's types
    from speculators_v016.run.tool_turns import read_chat  # noqa: PLC0415

    rows = chats(30, seed=12)
    rows[4] = {"conversations": [{"from": "human", "value": "a question nobody answers"}]}
    data = write(tmp_path / "d.jsonl", rows)
    _, loaded, _, _ = load_rows([data], False, None, reader=read_chat)
    order = run_order(len(loaded), 0, None)
    whole, _ = plan([loaded[i] for i in order], False)
    index = build_index([data], False, None, reader=read_chat)
    try:
        mine, _ = plan((index.row(int(i)) for i in order), False, keep=lambda n: n % 3 == 1)
    finally:
        index.close()
    assert [(c.number, c.where, c.first_index, c.answers) for c in mine] == [
        (c.number, c.where, c.first_index, c.answers) for c in whole
    ]
    assert all(m.turns == (w.turns if w.number % 3 == 1 else []) for m, w in zip(mine, whole, strict=True))
    assert [m.unanswered for m in mine] == [any(t["content"] is None for t in w.turns) for w in whole]
    assert any(m.unanswered for m in mine)


def test_verify_counts_a_shards_gaps_as_samples_not_written():
    """verify's completeness check takes the last run's gaps (rows dropped after tokenizing) as samples not written."""
    from speculators_v016.store.verify import _skipped  # noqa: PLC0415 - the one function of verify this needs

    assert _skipped({"dropped": 3, "non_finite": [{"index": 1, "layers": [2]}]}) == 4
    assert _skipped({"dropped": True}) == 0 and _skipped({}) == 0


def test_the_cache_keys_each_sources_cap_and_the_duplicates_option(tmp_path, tok):
    """Two runs sharing a cache that differ only by a source's cap, or only by --keep-duplicate-rows: the second
    gets its own rows (those of a run without a cache), never the first run's cached index or chunks."""
    rows = chats(12, seed=13)
    rows[7] = rows[3]  # one duplicate row
    data = write(tmp_path / "d.jsonl", rows)
    cache = tmp_path / "cache"

    def run(given: str, **kwargs) -> tuple:
        got = prepare_samples([given], tok, 4096, num_proc=1, cache=cache, **kwargs)
        alone = prepare_samples([given], tok, 4096, num_proc=1, **kwargs)
        assert as_pairs(got) == as_pairs(alone) and got.skipped == alone.skipped and got.sources == alone.sources
        return as_pairs(got), dict(got.skipped)

    whole, skipped = run(data)
    assert len(whole) == 11 and skipped == {"duplicate row": 1}
    capped, _ = run(f"{data}#max=4")
    assert len(capped) == 4 and capped != whole[:4]  # the first 4 rows of the file, shuffled: not the whole's
    kept, skipped = run(data, keep_duplicates=True)
    assert len(kept) == 12 and skipped == {}
    assert run(data) == (whole, {"duplicate row": 1})  # the first entries, still there and still right
