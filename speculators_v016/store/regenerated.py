"""What ``--regenerate`` wrote, as text: a journal while the run goes, the conversations file after it.

``regenerated.journal.jsonl``: one line per generated sample (its index, source row, turn, prompt
length, sampled ids, text, finish reason, seed), appended and fsynced *before* the sample goes to the
writer, so every sample the manifest lists has its line (a line without a listed sample, from a
killed run, is ignored; a later line of the same index wins). A resume reads it for the text of the
turns already written, the history of the turns still to come.

``regenerated.jsonl``: the regenerated conversations, one JSON object per line in the run's order
(turns with their text and finish reason, each assistant turn naming its sample), written whole and
atomically at the end of each run from the journal's lines of listed samples: it depends only on
what is written, so a resumed run's file equals an uninterrupted run's.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from speculators_v016.store import no_links
from speculators_v016.store.atomic_files import WriteError, write_atomic
from speculators_v016.store.sample_format import load_sample, read_input_ids

JOURNAL = "regenerated.journal.jsonl"
CONVERSATIONS = "regenerated.jsonl"
#: the run summary's reason for turns without room under --seq-length (verify counts them as skipped)
NOT_GENERATED = "turn not generated (prompt reaches --seq-length)"
#: the run summary's reason for turns after a regenerated tool call that differs from the source's (verify counts
#: them as skipped); the log line of each such turn starts with TOOL_STOP
STOPPED = "turn not generated (conversation stopped at a tool call other than the source's)"
TOOL_STOP = "tool_call_mismatch"
#: the log line's start for turns after one whose calls cannot be read (JSON nested too deeply): counted as STOPPED
TOOL_UNREADABLE = "tool_call_unreadable"


def not_generated(why: str) -> str:
    """The run summary's skip reason of a turn not generated, by the log line's ``why``."""
    return STOPPED if why.startswith((TOOL_STOP, TOOL_UNREADABLE)) else NOT_GENERATED


class JournalError(ValueError):
    """The journal is not one this tool wrote as it is (a line that is not a record, a listed sample without its
    line): the message names the file and line. A run refuses the folder (exit 4); verify names it."""


_TOO_DEEP = object()  # a journal line nested past the JSON decoder's recursion


def read_journal(directory: Path, problems: list[str] | None = None) -> dict[int, dict]:
    """The journal's records by sample index (a later line wins; a torn last line is ignored).

    A line that parses but is not a record (a JSON list, no integer ``index``) raises JournalError
    naming it; with ``problems`` given (verify), it is appended there instead and the other lines are read."""
    path = directory / JOURNAL
    records: dict[int, dict] = {}
    try:
        fh = no_links.open_to_read(path)  # never through a link
    except FileNotFoundError:
        return records
    except OSError as exc:
        finding = f"{path}: cannot be read ({exc.strerror or exc})"
        if problems is None:
            raise JournalError(finding) from None
        problems.append(finding)
        return records
    with fh:
        for number, raw in enumerate(fh, 1):
            if not raw.endswith(b"\n"):
                break  # the line a killed run was writing
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # a line a killed run left torn, ended by the next run (its sample is not listed)
            except RecursionError:  # no record of ours nests: a line written by something else
                record = _TOO_DEEP
            why = "JSON nested too deeply" if record is _TOO_DEEP else _not_a_record(record)
            if why:
                finding = f"{path}:{number}: not a record this tool writes ({why})"
                if problems is None:
                    raise JournalError(f"{finding}: not a folder this tool wrote as it is")
                problems.append(finding)
                continue
            records[record["index"]] = record
    return records


def _not_a_record(record) -> str | None:
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    index = record.get("index")
    if isinstance(index, bool) or not isinstance(index, int):
        return f"index is {index!r}, not a sample index"
    return None


def text_problems(path: Path, record: dict, tokenizer) -> list[str]:
    """A listed sample's journal text against its sampled ids, decoded by the target's tokenizer as the run did
    (special tokens, the stop among them, left out)."""
    if not isinstance(record.get("text"), str):
        return [f"{path}: its {JOURNAL} record has no text"]
    try:
        decoded = tokenizer.decode(record["token_ids"], skip_special_tokens=True)
    except Exception as exc:  # noqa: BLE001 - ids the tokenizer cannot decode are a finding
        return [f"{path}: its sampled ids in {JOURNAL} do not decode ({type(exc).__name__}: {str(exc)[:100]})"]
    if decoded != record["text"]:
        return [f"{path}: its text in {JOURNAL} is not what its sampled ids decode to"]
    return []


class Journal:
    """The open journal of a run (appending)."""

    def __init__(self, directory: Path):
        self.path = directory / JOURNAL
        try:  # never through a link, only a regular file of one link (store.no_links)
            self._fh = os.fdopen(no_links.open_in_place(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT), "ab")
            end = os.fstat(self._fh.fileno()).st_size
            if end and not _ends_with_newline(self._fh.fileno(), end):
                self._fh.write(b"\n")  # end the line a killed run left torn: the next one starts clean
        except no_links.LinkedEntryError:
            raise
        except OSError as exc:
            raise WriteError(exc.errno, f"cannot write {self.path}: {exc.strerror or exc}") from exc

    def append(self, record: dict) -> None:
        """One record, on disk before this returns."""
        try:
            self._fh.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
        except OSError as exc:
            raise WriteError(exc.errno, f"cannot write {self.path}: {exc.strerror or exc}") from exc

    def close(self) -> None:
        self._fh.close()


def _ends_with_newline(fd: int, size: int) -> bool:
    return os.pread(fd, 1, size - 1) == b"\n"


def write_conversations(directory: Path, conversations: list[dict]) -> None:
    """``regenerated.jsonl``, whole and atomically."""
    text = "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in conversations)
    write_atomic(directory, CONVERSATIONS, text.encode())


def sample_problems(path: Path, record: dict | None, journal: dict[int, dict] | None = None) -> list[str]:
    """A listed sample against its journal lines: the sampled ids end it, and the ids of the turns folded into it
    (its record's ``earlier_turns``) stand where their records say; loss_mask is 1 exactly on all of them."""
    if record is None:
        return [f"{path}: listed, but {JOURNAL} has no record of it"]
    data = load_sample(path, dequantize_to=None)
    ids, mask = data["input_ids"].tolist(), data["loss_mask"].tolist()
    prompt, tokens = record.get("prompt_tokens"), record.get("token_ids")
    if not isinstance(prompt, int) or not isinstance(tokens, list) or prompt + len(tokens) != len(ids):
        return [f"{path}: {len(ids)} tokens, its {JOURNAL} record says {prompt} + {len(tokens or [])}"]
    problems, expected = [], [0] * prompt + [1] * len(tokens)
    if ids[prompt:] != tokens:
        problems.append(f"{path}: its generated ids differ from its {JOURNAL} record")
    earlier = record.get("earlier_turns", [])
    for turn in earlier if isinstance(earlier, list) else [earlier]:
        folded = (journal or {}).get(turn) if isinstance(turn, int) else None
        start, held = (folded or {}).get("prompt_tokens"), (folded or {}).get("token_ids")
        if not folded or not folded.get("in_later_sample") or not isinstance(start, int) or not isinstance(held, list):
            problems.append(f"{path}: holds turn {turn!r} by its {JOURNAL} record, which has no record of it folded")
            continue
        if start + len(held) > prompt or ids[start : start + len(held)] != held:
            problems.append(f"{path}: the ids of turn {turn} folded into it differ from its {JOURNAL} record")
            continue
        if folded.get("prompt_sha256") != prompt_digest(ids[:start]):
            problems.append(
                f"{path}: turn {turn} folded into it: its {JOURNAL} record's prompt_sha256 is not the digest of "
                "the ids before it here (its prompt)"
            )
        expected[start : start + len(held)] = [1] * len(held)
    if mask != expected:
        problems.append(f"{path}: loss_mask is not 1 on exactly the generated ids")
    return problems


def folder_problems(directory: Path, listed: set[int], journal: dict[int, dict], complete: bool) -> list[str]:
    """regenerated.jsonl against the journal: every assistant turn names a listed sample (the one holding it) and
    holds its text; ``complete``: every listed sample's turns are in it once."""
    path = directory / CONVERSATIONS
    try:
        text = no_links.read_bytes(path).decode("utf-8")  # never through a link
    except FileNotFoundError:
        return [f"{path}: missing (a --regenerate run writes it at its end)"] if complete else []
    except (OSError, UnicodeDecodeError) as exc:
        return [f"{path}: cannot be read ({getattr(exc, 'strerror', None) or exc})"]
    problems, seen = [], []
    for number, raw in enumerate(text.splitlines(), 1):
        try:
            line = json.loads(raw)
            turns = [t for t in line["turns"] if t["role"] == "assistant"]
            for turn in turns:
                own = turn.get("turn_index", turn["sample"])
                record = journal.get(own)
                if turn["sample"] not in listed or record is None:
                    problems.append(f"{path}:{number}: names sample {turn['sample']}, which is not listed")
                elif record["text"] != turn["content"] or record["finish_reason"] != turn["finish_reason"]:
                    problems.append(f"{path}:{number}: turn {own}'s text differs from {JOURNAL}")
                elif own != turn["sample"] and own not in journal[turn["sample"]].get("earlier_turns", ()):
                    problems.append(f"{path}:{number}: turn {own} is not held by sample {turn['sample']}")
                seen.append(own)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{path}:{number}: not a conversation this tool writes ({type(exc).__name__}: {exc})")
    wanted = set(listed) | folded_into(listed, journal)
    if complete and sorted(seen) != sorted(wanted):
        missing = sorted(wanted - set(seen))
        problems.append(f"{path}: lists {len(seen)} turns for {len(wanted)} written (absent: {missing[:5]})")
    return problems


def folded_into(listed, journal: dict[int, dict]) -> set[int]:
    """The turns folded into the ``listed`` samples, by their records' ``earlier_turns``."""
    out = set()
    for name in listed:
        earlier = journal.get(name, {}).get("earlier_turns", [])
        if isinstance(earlier, list):
            out.update(e for e in earlier if isinstance(e, int))
    return out


def prompt_digest(ids: list[int]) -> str:
    """A folded turn's prompt, as its record keeps it (``prompt_sha256``): a resume takes the turn only under the
    same prompt, and verify finds it before the turn in the sample holding it."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:32]


def render_prompt(tokenizer, history: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt of a turn: ``history`` rendered by the target's chat template with its generation prompt (the
    tool definitions passed where the conversation has them), as the run renders it."""
    extra = {"tools": tools} if tools else {}  # a conversation without tools renders as it always did
    ids = tokenizer.apply_chat_template(history, tokenize=True, add_generation_prompt=True, **extra)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def history_problems(directory: Path, journal: dict[int, dict], readable: dict[int, Path], tokenizer) -> list[str]:
    """Each turn's prompt, in the sample holding it, against its conversation's history as the target wrote it:
    regenerated.jsonl's turns of the source (system, user, tool results), the earlier turns' *sampled ids*
    decoded (never their recorded text), rendered by the chat template as the run renders them. A sample whose
    prompt holds other text (a resume that took an edited record as history) has the states of another text: named.
    ``readable``: the listed samples that passed their other checks, by name (the others are named already)."""
    path = directory / CONVERSATIONS
    try:
        text = no_links.read_bytes(path).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return []  # folder_problems names it
    problems = []
    for number, raw in enumerate(text.splitlines(), 1):
        try:
            line = json.loads(raw)
            tools, history, ids_of = line.get("tools") or None, [], {}
            for turn in line["turns"]:
                if turn["role"] != "assistant":
                    history.append({k: v for k, v in turn.items() if k in ("role", "content", "tool_call_id", "name")})
                    continue
                own, sample = turn.get("turn_index", turn["sample"]), turn["sample"]
                record = journal.get(own)
                if sample not in readable or not isinstance(record, dict):
                    break  # named by folder_problems or the sample's own checks
                if sample not in ids_of:
                    ids_of[sample] = read_input_ids(readable[sample])
                start = record["prompt_tokens"]
                if ids_of[sample][:start] != render_prompt(tokenizer, history, tools):
                    problems.append(
                        f"{readable[sample]}: the prompt of turn {own} is not its conversation's history as the "
                        f"target wrote it ({CONVERSATIONS}:{number}'s source turns, the earlier turns' sampled ids "
                        "decoded): its states are those of another text"
                    )
                    break
                content = tokenizer.decode(record["token_ids"], skip_special_tokens=True)
                history.append({"role": "assistant", "content": content})
        except (ValueError, KeyError, TypeError, AttributeError):
            continue  # folder_problems names the line
        except Exception as exc:  # noqa: BLE001 - a history the template or tokenizer refuses is a finding
            problems.append(f"{path}:{number}: its history cannot be rendered again ({type(exc).__name__}: {exc})")
    return problems
