"""--token-freq-path's file (upstream's token_freq.pt): written whole under a temporary name, never through a link; an
existing one (a file or a link) kept as upstream keeps it, and said (hostile review, 2026-12-07)."""

import os
from collections import Counter

import torch
from loguru import logger

from speculators_v016.run import prefill


def warnings_of(call):
    seen = []
    logger.enable("speculators_v016")
    sink = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    try:
        result = call()
    finally:
        logger.remove(sink)
        logger.disable("speculators_v016")
    return result, seen


def test_the_counts_are_written_whole_and_read_back_without_pickle(tmp_path):
    """A new path: the counts as a dict of ints, loadable with weights_only; no temporary file left."""
    path = tmp_path / "sub" / "token_freq.pt"
    assert prefill.save_token_counts(Counter({5: 3, 9: 1}), str(path))
    assert torch.load(path, weights_only=True) == {5: 3, 9: 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["token_freq.pt"]


def test_an_existing_file_is_kept_and_said(tmp_path):
    """An existing file is left as it is, and a warning says its counts are not this run's."""
    path = tmp_path / "token_freq.pt"
    path.write_bytes(b"someone else's")
    written, seen = warnings_of(lambda: prefill.save_token_counts(Counter({1: 1}), str(path)))
    assert not written and path.read_bytes() == b"someone else's"
    assert any("exists and is kept" in m and "not this run's" in m for m in seen), seen


def test_a_link_at_the_path_is_never_written_through(tmp_path):
    """A link (dangling, or to a file) at the path: nothing is written where it points, the link is kept."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for target in (elsewhere / "absent.pt", elsewhere / "present.pt"):
        if target.name == "present.pt":
            target.write_bytes(b"theirs")
        link = tmp_path / f"link-{target.name}"
        os.symlink(target, link)
        written, _ = warnings_of(lambda link=link: prefill.save_token_counts(Counter({1: 1}), str(link)))
        assert not written and link.is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["present.pt"]
    assert (elsewhere / "present.pt").read_bytes() == b"theirs"
