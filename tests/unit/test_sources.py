"""The inputs users have (issue 52 item 5): Parquet files and folders, datasets' save_to_disk folders, gzip and
Zstandard JSON Lines, hub dataset ids from the datasets cache, per-source caps, and exact duplicate rows dropped at
read time. Every file is written here; no hub, no network."""

import gzip
import json
import os
import sys

import pytest

from speculators_v016.run.dataset import BadRowError, load_rows
from speculators_v016.run.prepared import prepare_samples
from speculators_v016.run.sources import DUPLICATE, Duplicates, SourceError
from speculators_v016.testing.tiny_models import DEFAULT_CORPUS, train_tokenizer

# a tool-calling template (tool_calls on assistant turns, tool results): written here
TOOLS = (
    "{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant' }}"
    "{% if m.content %}{{ '\\n' + m.content }}{% endif %}{% for c in m.tool_calls or [] %}"
    "{{ '\\n<tool_call>' + c.function.name + ' ' + c.function.arguments | tojson + '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chats(count: int, offset: int = 0) -> list[dict]:
    """Conversation rows in both shapes, one with a tool call and its result every few rows (struct fields that
    only some rows have: nulls in Arrow)."""
    rows = []
    for i in range(offset, offset + count):
        question, answer = f"question {i} {DEFAULT_CORPUS[i % 5]}", f"answer {i} {DEFAULT_CORPUS[(i + 2) % 5]}"
        if i % 3 == 0:
            rows.append({"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
        elif i % 3 == 1:
            rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
        else:
            call = {"type": "function", "function": {"name": "lookup", "arguments": {"query": f"q{i}"}}}
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": f"result {i}", "name": "lookup"},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
    return rows


def pretokenized(count: int) -> list[dict]:
    return [{"input_ids": list(range(10 + i, 30 + i)), "loss_mask": [0] * 5 + [1] * 15} for i in range(count)]


@pytest.fixture(scope="module")
def tok():
    tok = train_tokenizer(DEFAULT_CORPUS + ["question answer lookup result tool_call"])
    tok.chat_template = TOOLS
    return tok


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path, rows, **kwargs):
    import pyarrow as pa  # noqa: PLC0415 - pyarrow is slow to import; only these tests need it
    import pyarrow.parquet as pq  # noqa: PLC0415 - as above

    pq.write_table(pa.Table.from_struct_array(pa.array(rows)), path, **kwargs)  # columns: every row's keys
    return path


def jsonl_bytes(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def zstandard():
    import zstandard  # noqa: PLC0415 - only the .zst tests need it (a dependency: setup.cfg)

    return zstandard


def samples(paths, tok, **kwargs):
    out = prepare_samples([str(p) for p in paths], tok, 256, num_proc=1, **kwargs)
    return out.input_ids, out.loss_masks, dict(out.skipped)


def save_to_disk(folder, rows, splits=None):
    import datasets  # noqa: PLC0415 - datasets is slow to import; only these tests need it
    import pyarrow as pa  # noqa: PLC0415 - pyarrow is slow to import; only these tests need it

    def dataset(rows):  # columns: every row's keys (Dataset.from_list takes the first row's only)
        return datasets.Dataset(datasets.table.InMemoryTable(pa.Table.from_struct_array(pa.array(rows))))

    if splits is None:
        dataset(rows).save_to_disk(str(folder))
    else:
        datasets.DatasetDict({s: dataset(r) for s, r in splits.items()}).save_to_disk(str(folder))
    return folder


def test_the_same_rows_in_every_format_give_the_same_samples(tmp_path, tok):
    """The same conversation rows (both shapes, tool calls) as JSON Lines, a .json array, .jsonl.gz, .jsonl.zst,
    Parquet, a Parquet folder and a save_to_disk folder: the same samples, bit for bit."""
    rows = chats(12)
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    want = samples([jsonl], tok)
    assert len(want[0]) == 12 and not want[2]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(rows)))
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard().ZstdCompressor().compress(jsonl_bytes(rows)))
    write_parquet(tmp_path / "d.parquet", rows, row_group_size=5)
    (tmp_path / "folder").mkdir()
    write_parquet(tmp_path / "folder" / "part-0.parquet", rows[:7])
    write_parquet(tmp_path / "folder" / "part-1.parquet", rows[7:])
    save_to_disk(tmp_path / "saved", rows)
    save_to_disk(tmp_path / "dict", None, {"train": rows, "test": rows[:2]})
    for given in ["d.json", "d.jsonl.gz", "d.jsonl.zst", "d.parquet", "folder", "saved", "dict@train"]:
        assert samples([tmp_path / given], tok) == want, given


def test_pretokenized_rows_read_the_same_from_parquet(tmp_path):
    """Pre-tokenized rows in Parquet: the same ids and masks as in JSON Lines."""
    rows = pretokenized(5)
    from_json = load_rows([str(write_jsonl(tmp_path / "t.jsonl", rows))], False, None)
    from_parquet = load_rows([str(write_parquet(tmp_path / "t.parquet", rows))], False, None)
    assert from_json[0] == from_parquet[0] == "pretokenized"
    assert [r[1] for r in from_json[1]] == [r[1] for r in from_parquet[1]]
    assert [r[0] for r in from_parquet[1]] == [f"{tmp_path / 't.parquet'} row {i}" for i in range(5)]


@pytest.mark.parametrize(
    "columns, missing",
    [
        ({"text": ["a"], "id": [1]}, "missing: conversations, messages, input_ids, loss_mask (its columns: text, id)"),
        ({"input_ids": [[1, 2]], "text": ["a"]}, "missing: loss_mask (its columns: input_ids, text)"),
    ],
)
def test_a_parquet_file_without_the_columns_rows_need_names_them(tmp_path, columns, missing):
    """A Parquet file with neither conversation nor pre-tokenized columns (or half of the latter): SourceError
    naming the file and the missing columns, before any row is read; --skip-bad-rows does not skip it."""
    import pyarrow as pa  # noqa: PLC0415 - pyarrow is slow to import; only these tests need it
    import pyarrow.parquet as pq  # noqa: PLC0415 - as above

    good = write_jsonl(tmp_path / "good.jsonl", chats(2))
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table(columns), bad)
    with pytest.raises(SourceError) as info:
        load_rows([str(good), str(bad)], True, None)
    assert str(info.value).startswith(f"{bad}: ") and str(info.value).endswith(missing)
    with pytest.raises(SourceError, match=f"{bad}: "):  # a folder holding it too
        load_rows([str(tmp_path)], True, None)


def test_a_file_that_is_not_parquet_is_refused_naming_it(tmp_path):
    """Bytes that are not Parquet under a .parquet name: SourceError naming the file."""
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(SourceError, match=rf"^{bad}: not a readable Parquet file"):
        load_rows([str(bad)], True, None)


def test_a_parquet_folder_is_read_in_name_order_and_never_through_a_link_out(tmp_path):
    """A folder's *.parquet files in name order (sub-folders and other files not read); a link to a file outside
    the folder is refused naming it; an empty folder is refused."""
    rows = chats(6)
    folder = tmp_path / "folder"
    folder.mkdir()
    write_parquet(folder / "b.parquet", rows[3:])
    write_parquet(folder / "a.parquet", rows[:3])
    (folder / "notes.txt").write_text("not read")
    (folder / "sub").mkdir()
    write_parquet(folder / "sub" / "c.parquet", chats(2, offset=50))
    _, read, sources, _ = load_rows([str(folder)], False, None)
    assert [w for w, _ in read] == [f"{folder / n} row {i}" for n in ("a.parquet", "b.parquet") for i in range(3)]
    assert [f["name"] for f in sources[0]["files"]] == ["a.parquet", "b.parquet"]
    assert sources[0]["path"] == str(folder.resolve()) and len(sources[0]["files"][0]["sha256"]) == 64
    outside = write_parquet(tmp_path / "outside.parquet", chats(1, offset=90))
    (folder / "c.parquet").symlink_to(outside)
    with pytest.raises(SourceError) as info:
        load_rows([str(folder)], False, None)
    assert f"{folder / 'c.parquet'} is a link to {outside}, outside the folder" in str(info.value)
    (folder / "c.parquet").unlink()
    (folder / "c.parquet").symlink_to("a.parquet")  # a link inside the folder is read
    assert len(load_rows([str(folder)], False, None, keep_duplicates=True)[1]) == 9
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="a folder holding no \\*.parquet files and not a datasets save_to_disk"):
        load_rows([str(tmp_path / "empty")], False, None)


def test_a_parquet_folder_of_several_splits_needs_one_named(tmp_path):
    """Files named as the hub names splits (train-00000-of-00001.parquet, test-...): refused without a split,
    naming them; FOLDER@SPLIT reads that split's files only."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_parquet(folder / "train-00000-of-00002.parquet", chats(2))
    write_parquet(folder / "train-00001-of-00002.parquet", chats(2, offset=2))
    write_parquet(folder / "test-00000-of-00001.parquet", chats(1, offset=10))
    with pytest.raises(SourceError, match=r"holds the Parquet files of several splits \(test, train\); name one: "):
        load_rows([str(folder)], False, None)
    _, read, sources, _ = load_rows([f"{folder}@train"], False, None)
    assert len(read) == 4 and sources[0]["split"] == "train"
    with pytest.raises(SourceError, match="no Parquet file of split 'validation'"):
        load_rows([f"{folder}@validation"], False, None)


def test_parquet_is_read_a_batch_at_a_time(tmp_path):
    """Reading a Parquet file of many row groups allocates Arrow memory for a few row groups, not the file."""
    import pyarrow as pa  # noqa: PLC0415 - pyarrow is slow to import; only these tests need it
    import pyarrow.parquet as pq  # noqa: PLC0415 - as above

    rows, width = 6000, 400
    ids = pa.array(range(rows * width), pa.int64())
    offsets = pa.array(range(0, rows * width + 1, width), pa.int32())
    table = pa.table({"input_ids": pa.ListArray.from_arrays(offsets, ids)})
    table = table.append_column("loss_mask", table["input_ids"])
    data = tmp_path / "big.parquet"
    pq.write_table(table, data, row_group_size=100)
    del table, ids
    decoded = rows * width * 8 * 2  # the columns as Arrow holds them: 38 MB, 0.64 MB a row group
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    before = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    try:
        count = sum(1 for _ in _rows_of(data))
    finally:
        pa.set_memory_pool(before)
    assert count == rows
    assert pool.max_memory() < decoded / 4, (pool.max_memory(), decoded)  # measured: 5.5 MB


def _rows_of(path):
    from speculators_v016.run import dataset, sources  # noqa: PLC0415 - the readers, for one source's rows alone

    source = sources.open_source(str(path), None, dataset.json_readers())
    return source.rows(Duplicates(keep=True))


def test_a_corrupt_gzip_archive_is_an_error_naming_file_and_line(tmp_path):
    """A .jsonl.gz cut short or with a flipped byte: SourceError naming the file and the last line read (never a
    short dataset), also with --skip-bad-rows."""
    whole = gzip.compress(jsonl_bytes(chats(200)))
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(SourceError, match=rf"^{cut}: not a readable gzip archive \(.*; after {cut}:\d+\)$"):
        load_rows([str(cut)], True, None)
    flipped = tmp_path / "flipped.jsonl.gz"
    flipped.write_bytes(whole[:-6] + bytes([whole[-6] ^ 0xFF]) + whole[-5:])  # the CRC of the content
    with pytest.raises(SourceError, match=rf"^{flipped}: not a readable gzip archive \(CRC check failed"):
        load_rows([str(flipped)], True, None)
    plain = tmp_path / "plain.jsonl.gz"
    plain.write_bytes(jsonl_bytes(chats(2)))
    with pytest.raises(SourceError, match=rf"^{plain}: not a readable gzip archive \(.*before its first line\)$"):
        load_rows([str(plain)], True, None)


def test_a_truncated_zstandard_archive_is_an_error_not_a_short_dataset(tmp_path):
    """A .jsonl.zst cut inside its frame (zstandard's own stream reader ends there quietly): SourceError naming the
    file and the last line read; two frames back to back are read whole."""
    z = zstandard()
    rows = [{**row, "id": os.urandom(64).hex()} for row in chats(3000)]  # not compressible: several blocks
    whole = z.ZstdCompressor().compress(jsonl_bytes(rows))
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(SourceError, match=rf"^{cut}: not a readable Zstandard archive \(.*truncated.*; after {cut}:"):
        load_rows([str(cut)], True, None)
    two = tmp_path / "two.jsonl.zst"
    two.write_bytes(whole + z.ZstdCompressor().compress(jsonl_bytes(chats(3, offset=5000))))
    assert len(load_rows([str(two)], False, None)[1]) == 3003
    garbage = tmp_path / "garbage.jsonl.zst"
    garbage.write_bytes(b"this is not zstandard data\n")
    with pytest.raises(SourceError, match=rf"^{garbage}: not a readable Zstandard archive"):
        load_rows([str(garbage)], True, None)


def test_zstandard_input_without_the_package_names_it(tmp_path, monkeypatch):
    """Without the zstandard package a .jsonl.zst is refused naming the package (never read as something else)."""
    data = tmp_path / "d.jsonl.zst"
    data.write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(SourceError, match=rf"{data}: reading Zstandard \(.zst\) needs the 'zstandard' package"):
        load_rows([str(data)], False, None)


def test_a_save_to_disk_dataset_dict_needs_a_split_and_names_those_present(tmp_path):
    """A DatasetDict folder without @SPLIT, or with one it lacks: SourceError naming the splits present."""
    folder = save_to_disk(tmp_path / "dict", None, {"train": chats(3), "test": chats(1, offset=9)})
    with pytest.raises(
        SourceError, match=rf"is a DatasetDict: name a split \(splits: test, train\), e.g. {folder}@test$"
    ):
        load_rows([str(folder)], False, None)
    with pytest.raises(SourceError, match=r"has no split 'valid' \(splits: test, train\)"):
        load_rows([f"{folder}@valid"], False, None)
    _, read, sources, _ = load_rows([f"{folder}@test"], False, None)
    assert [w for w, _ in read] == [f"{folder}@test row 0"]
    assert sources[0]["split"] == "test" and [f["name"] for f in sources[0]["files"]][0] == "test/state.json"


def test_a_save_to_disk_folder_naming_a_data_file_outside_it_is_refused(tmp_path):
    """state.json naming ../elsewhere.arrow (a file name from data): refused before datasets opens anything."""
    folder = save_to_disk(tmp_path / "saved", chats(2))
    state = json.loads((folder / "state.json").read_text())
    real = state["_data_files"][0]["filename"]
    (tmp_path / "elsewhere.arrow").write_bytes((folder / real).read_bytes())
    state["_data_files"][0]["filename"] = "../elsewhere.arrow"
    (folder / "state.json").write_text(json.dumps(state))
    with pytest.raises(SourceError, match=r"names a data file '../elsewhere.arrow' that is not a plain file name"):
        load_rows([str(folder)], False, None)


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    """A datasets cache holding org/chats (config default, split train) as a hub load leaves it, made by datasets'
    own Parquet builder from a local file, and the hub unreachable (offline mode)."""
    import datasets  # noqa: PLC0415 - datasets is slow to import; only these tests need it
    import huggingface_hub  # noqa: PLC0415 - as above
    from datasets.data_files import DataFilesDict  # noqa: PLC0415 - as above
    from datasets.packaged_modules.parquet.parquet import Parquet  # noqa: PLC0415 - as above

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    source = write_parquet(tmp_path / "train.parquet", chats(5))
    files = DataFilesDict.from_patterns({"train": [str(source)]})
    builder = Parquet(
        cache_dir=str(tmp_path / "build"), dataset_name="chats", config_id="default", data_files=files, hash="0a1b2c3d"
    )  # the hash: a hub revision's, as a hub load names its folder
    builder.download_and_prepare()
    cache = tmp_path / "cache"
    cache.mkdir()
    os.rename(tmp_path / "build" / "chats", cache / "org___chats")  # where a load of org/chats keeps it
    return cache


def test_a_hub_dataset_id_loads_from_the_cache_without_a_hub(tmp_path, hub_cache, tok):
    """org/chats@train with no hub reachable: read from the datasets cache, the same samples as its rows in JSON
    Lines; the source names the id, config, split and the cached files' sha256."""
    want = samples([write_jsonl(tmp_path / "d.jsonl", chats(5))], tok)
    got = prepare_samples(["org/chats@train"], tok, 256, num_proc=1, hf_cache_dir=str(hub_cache))
    assert (got.input_ids, got.loss_masks, dict(got.skipped)) == want
    [source] = got.sources
    assert (source["dataset"], source["config"], source["split"]) == ("org/chats", None, "train")
    assert [f["name"] for f in source["files"]] == ["chats-train.arrow"] and len(source["files"][0]["sha256"]) == 64


@pytest.mark.parametrize("given", ["org/absent@train", "org/chats:other@train", "org/chats@test"])
def test_an_unknown_dataset_id_config_or_split_names_it(hub_cache, given):
    """An id, config or split the cache lacks, no hub reachable: SourceError naming the id and the cache."""
    with pytest.raises(SourceError) as info:
        load_rows([given], False, str(hub_cache))
    message = str(info.value)
    name = given.split("@")[0].split(":")[0]
    assert message.startswith(f"--train-data-path {given}: no such file or folder, and dataset '{name}'")
    assert f"not in the datasets cache {hub_cache}" in message


def test_a_cap_keeps_each_sources_first_rows_before_the_shuffle(tmp_path, tok):
    """a.jsonl#max=3 and b.parquet#max=2: the first 3 and 2 rows of each, in file order, then the run's shuffle
    (the samples are the shuffle of exactly those rows); the cap is in the source's description."""
    a, b = chats(10), chats(10, offset=100)
    paths = [f"{write_jsonl(tmp_path / 'a.jsonl', a)}#max=3", f"{write_parquet(tmp_path / 'b.parquet', b)}#max=2"]
    _, read, sources, _ = load_rows(paths, False, None)
    assert [w for w, _ in read] == [f"{tmp_path / 'a.jsonl'}:{i}" for i in (1, 2, 3)] + [
        f"{tmp_path / 'b.parquet'} row {i}" for i in (0, 1)
    ]
    assert [s["max_rows"] for s in sources] == [3, 2]
    capped = prepare_samples(paths, tok, 256, num_proc=1, seed=4)
    alone = prepare_samples([str(write_jsonl(tmp_path / "first.jsonl", a[:3] + b[:2]))], tok, 256, num_proc=1, seed=4)
    assert capped.input_ids == alone.input_ids and capped.loss_masks == alone.loss_masks
    with pytest.raises(SourceError, match=r"a cap is written WHAT#max=N"):
        load_rows([f"{tmp_path / 'a.jsonl'}#max=all"], False, None)
    with pytest.raises(SourceError, match=r"a cap keeps at least 1 row"):
        load_rows([f"{tmp_path / 'a.jsonl'}#max=0"], False, None)


def test_duplicate_rows_are_dropped_first_one_kept_and_counted(tmp_path):
    """Rows whose used fields are exactly an earlier row's, in this source or an earlier one: dropped and counted
    ('duplicate row', and per source), the first occurrence kept; other fields (an id) do not make a row new, other
    tools or another loss mask do; keep_duplicates keeps them all."""
    base = chats(3)
    with_id = {**base[1], "id": "row-b"}
    with_tools = {**base[1], "tools": [{"type": "function", "function": {"name": "lookup"}}]}
    a = write_jsonl(tmp_path / "a.jsonl", [base[0], base[1], base[0], with_id, with_tools])
    b = write_parquet(tmp_path / "b.parquet", [base[2], base[1]])
    _, read, sources, skipped = load_rows([str(a), str(b)], False, None)
    assert [w for w, _ in read] == [f"{a}:1", f"{a}:2", f"{a}:5", f"{b} row 0"]
    assert skipped == {DUPLICATE: 3} and DUPLICATE == "duplicate row"
    assert [s.get("duplicate_rows") for s in sources] == [2, 1]
    _, kept, sources, skipped = load_rows([str(a), str(b)], False, None, keep_duplicates=True)
    assert len(kept) == 7 and not skipped and all("duplicate_rows" not in s for s in sources)
    tokens = pretokenized(2) + [{**pretokenized(1)[0], "loss_mask": [1] * 20}, pretokenized(1)[0]]
    _, read, _, skipped = load_rows([str(write_jsonl(tmp_path / "t.jsonl", tokens))], False, None)
    assert len(read) == 3 and skipped == {DUPLICATE: 1}


def test_a_source_given_twice_is_read_once_unless_duplicates_are_kept(tmp_path, tok):
    """The same file twice (weighing it twice): its second reading is all duplicates; with keep_duplicates twice
    the samples."""
    data = str(write_jsonl(tmp_path / "d.jsonl", chats(4)))
    once = samples([data, data], tok)
    assert len(once[0]) == 4 and once[2] == {DUPLICATE: 4}
    assert len(samples([data, data], tok, keep_duplicates=True)[0]) == 8


def test_a_plain_json_files_description_is_unchanged(tmp_path):
    """Without a cap or a duplicate, a .jsonl source is described as before (path and sha256 only), so folders of
    earlier releases resume; duplicates dropped change it (their samples would differ)."""
    data = write_jsonl(tmp_path / "d.jsonl", chats(2))
    _, _, sources, _ = load_rows([str(data)], False, None)
    assert sources == [{"path": str(data.resolve()), "sha256": sources[0]["sha256"]}]
    write_jsonl(data, chats(2) + chats(1))
    assert load_rows([str(data)], False, None)[2][0]["duplicate_rows"] == 1


def test_every_source_is_checked_before_any_is_read(tmp_path, monkeypatch):
    """A bad second input is refused before the first is read (no time spent on a run that cannot start)."""
    import speculators_v016.run.dataset as dataset  # noqa: PLC0415 - the module whose reader is watched

    read = []
    monkeypatch.setattr(dataset, "_read_located", lambda path: read.append(path) or iter(()))
    good = write_jsonl(tmp_path / "good.jsonl", chats(2))
    with pytest.raises(BadRowError, match="no such file"):
        load_rows([str(good), str(tmp_path / "missing.parquet")], False, None)
    assert read == []


def test_a_hub_dataset_is_read_only_by_a_data_files_builder(hub_cache, monkeypatch):
    """A hub dataset whose builder is not one that reads data files (a pickle reader, say) is refused naming the
    builder, before it reads anything: here the cache's own builder taken off the list."""
    import speculators_v016.run.sources as sources  # noqa: PLC0415 - the module whose list is shortened

    monkeypatch.setattr(sources, "HUB_BUILDERS", frozenset({"parquet", "json"}))
    with pytest.raises(SourceError, match=r"would be read by datasets' 'cache' builder; its rows are read from json, "):
        load_rows(["org/chats@train"], False, str(hub_cache))


def test_a_file_with_a_split_is_refused(tmp_path):
    """chats.json@train: a split names a folder's, never a file's (nor the file sent to datasets as an id)."""
    (tmp_path / "chats.json").write_text("[]")
    with pytest.raises(SourceError, match=r"chats.json is a file: a split \(@train\) names a folder's"):
        load_rows([f"{tmp_path / 'chats.json'}@train"], False, None)


def test_every_format_gives_the_same_samples_sharded_cached_and_read_ahead(tmp_path, tok, monkeypatch):
    """Every format through a shard's path (rows read again by locator, 4-row chunks, rows of inputs that cannot
    seek read 8 at a time ahead): each shard's samples and names are those of the JSON Lines file, first tokenized
    then from the cache; a compressed file is read once per 8 rows of a shard, not once per row."""
    from speculators_v016.run import prepared, sources  # noqa: PLC0415 - the chunk and read-ahead sizes shrunk

    monkeypatch.setattr(prepared, "CHUNK_ROWS", 4)
    monkeypatch.setattr(prepared, "PREFETCH_ROWS", 8)
    rows = chats(30)
    jsonl = write_jsonl(tmp_path / "d.jsonl", rows)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(rows)))
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard().ZstdCompressor().compress(jsonl_bytes(rows)))
    write_parquet(tmp_path / "d.parquet", rows, row_group_size=7)
    (tmp_path / "folder").mkdir()
    write_parquet(tmp_path / "folder" / "part-0.parquet", rows[:11], row_group_size=3)
    write_parquet(tmp_path / "folder" / "part-1.parquet", rows[11:])
    save_to_disk(tmp_path / "saved", rows)
    passes = []
    original = sources._Archive.rows_at
    monkeypatch.setattr(sources._Archive, "rows_at", lambda self, at: passes.append(len(at)) or original(self, at))

    def shard(given, shards, index, cache=None):
        got = prepare_samples(
            [str(given)], tok, 256, num_proc=1, num_shards=shards, shard_index=index, seed=2, cache=cache
        )
        return got.names.tolist(), list(got.input_ids), list(got.loss_masks)

    for shards in (1, 3):
        want = [shard(jsonl, shards, i) for i in range(shards)]
        assert sorted(n for w in want for n in w[0]) == list(range(30))
        for given in ["d.jsonl.gz", "d.jsonl.zst", "d.parquet", "folder", "saved"]:
            cache = tmp_path / f"cache-{given}-{shards}"
            for _ in range(2):  # tokenized, then from the cache
                assert [shard(tmp_path / given, shards, i, cache) for i in range(shards)] == want, (given, shards)
    assert passes and max(passes) <= 8 and len(passes) == 2 * (4 + 3 * 2)  # gz and zst: ceil(30/8), 3 x ceil(10/8)
