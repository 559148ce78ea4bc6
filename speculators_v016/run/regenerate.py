"""On-policy samples (``--regenerate``): the target writes every assistant turn, and the run captures it.

For each conversation the target answers each of its assistant turns in order, conditioned on the
history as regenerated so far: the source's assistant turns are never shown to it. Each prompt is the
history rendered by the target's chat template with its generation prompt, as a server renders a
chat request (where the template drops earlier turns' reasoning, so does the prompt).

**Samples** (``--regenerate-samples``). With ``turn``, one sample per generated turn, for every
template: ``input_ids`` = the prompt's ids + the ids the target sampled (never re-tokenized from
text), ``loss_mask`` = 1 on the sampled ids. With ``auto`` (the default), a generated turn is
*folded* into the sample of its conversation's next turn where the chat template renders the
next prompt as this turn's prompt + its sampled ids, token for token (decided by rendering, per
turn, never by the template's name): the sample of the last turn of such a run of turns holds
them all, ``loss_mask`` 1 on every turn's sampled ids. Where the template drops earlier
reasoning, or re-tokenizes the turn's text otherwise than it was sampled, the turn keeps its own
sample. Either way the ids before every supervised position are exactly those the target
conditioned on when it sampled it. A folded turn's states are those of the later turn's pass:
its prompt holds the folded turn, prefilled (prefix caching is off: each turn's history is
prefilled to generate it), so each position's states are computed for exactly its prefix.
A folded turn's index has no file; its record in the journal says so, and the record of the
sample holding it names it (``earlier_turns``).

This module is the plan and the feed (:class:`Regeneration`): which samples exist (their indices
are fixed before anything runs, so resume and sharding work as for prefill runs), each turn's
prompt, its sampling settings (:func:`resolve_sampling`) and seed, and the record of what was
generated (:mod:`speculators_v016.store.regenerated` keeps those records on disk).
"""

from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from speculators_v016.engine.generation import Generated, Generation, sample_seed
from speculators_v016.run import tool_turns
from speculators_v016.run.dataset import BadRowError, run_order
from speculators_v016.run.row_index import build_index
from speculators_v016.run.turns import READ_RULES, messages
from speculators_v016.store import regenerated
from speculators_v016.store.regenerated import prompt_digest
from speculators_v016.store.sample_format import read_input_ids
from speculators_v016.target import GenerationSetupError


@dataclass(frozen=True)
class Sampling:
    """The run's sampling settings, resolved: the option where given, else the target's
    ``generation_config.json`` (``from_model`` names which came from there)."""

    temperature: float
    top_p: float
    top_k: int  # 0: off
    max_new_tokens: int | None  # None: up to --seq-length
    seed: int
    from_model: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}


def _generation_config(model_path: str) -> dict | None:
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GenerationSetupError(f"{path}: not readable JSON ({exc})") from exc


def resolve_sampling(
    model_path: str,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    max_new_tokens: int | None,
    seed: int,
) -> Sampling:
    """The sampling settings: each option given wins; the rest come from the target's generation_config.json
    (``do_sample: false`` there means greedy). Without that file the temperature must be given."""
    config = _generation_config(model_path)
    if config is None:
        if temperature is None:
            raise GenerationSetupError(
                f"{model_path} has no generation_config.json, so the target's sampling settings are unknown: "
                "give --temperature (and --top-p, --top-k if the model wants them)"
            )
        config = {}
    from_model = []
    if temperature is None:
        if config.get("do_sample") is False:
            temperature = 0.0
        else:
            temperature = float(config.get("temperature", 1.0))
        from_model.append("temperature")
    if top_p is None:
        top_p = float(config.get("top_p", 1.0))
        from_model += ["top_p"] if "top_p" in config else []
    if top_k is None:
        top_k = int(config.get("top_k", 0) or 0)
        from_model += ["top_k"] if "top_k" in config else []
    if max_new_tokens is None and config.get("max_new_tokens"):
        max_new_tokens = int(config["max_new_tokens"])
        from_model.append("max_new_tokens")
    return Sampling(temperature, top_p, top_k, max_new_tokens, seed, tuple(from_model))


def stop_token_ids(tokenizer, model_path: str) -> frozenset[int]:
    """Where a turn ends: the tokenizer's and generation_config's EOS ids, and the template's end of turn
    (the special token the template writes right after an assistant turn's text)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = (_generation_config(model_path) or {}).get("eos_token_id")
    ids.update(int(i) for i in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
    ids |= end_of_turn_ids(tokenizer)
    return frozenset(ids)


def end_of_turn_ids(tokenizer) -> set[int]:
    """The special token right after an assistant turn's text in the template's rendering (none if plain text)."""
    marker = "regenerate probe text"
    chat = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this has no end of turn to find
        return set()
    after = text[text.find(marker) + len(marker) :] if marker in text else ""
    special = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)
    }
    head = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    return {int(head[0])} if head and head[0] in special else set()


def check_generation_prompt(tokenizer) -> None:
    """Refuse a chat template that adds nothing for ``add_generation_prompt`` (the target would continue the
    user's text, not answer it)."""
    chat = [{"role": "user", "content": "hello"}]
    try:
        plain = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        prompted = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template's own error, named
        raise GenerationSetupError(f"the target's chat template cannot render a user turn: {exc}") from exc
    if plain == prompted:
        raise GenerationSetupError(
            "the target's chat template has no generation prompt (add_generation_prompt adds nothing), so it "
            "cannot start an assistant turn: --regenerate needs a chat model's template"
        )


@dataclass
class Conversation:
    """A source conversation as regeneration sees it: its turns, and where its samples start."""

    number: int  # position in the run's (shuffled, cut) order
    where: str  # file:line of the source row
    turns: list[dict]  # role/content; the assistant turns' content is the source's (never shown; None: none)
    first_index: int  # the sample index of its first assistant turn
    answers: int  # assistant turns to generate (one sample each)
    tools: list[dict] | None = None  # the tool definitions, passed to the chat template (None: none)
    # facts of its turns, kept where its turns are not (a conversation of another shard: turns [])
    with_tools: bool = False  # tools or tool turns
    unanswered: bool = False  # a user turn no source answer follows

    @property
    def uses_tools(self) -> bool:
        return tool_turns.uses_tools(self.turns, self.tools)


def answer_slots(turns: list[dict]) -> list[dict]:
    """``turns`` with an assistant turn to generate (content None: there is no source answer) after each user
    turn past the source's last assistant turn: a prompt-only row gets each user turn answered in order, a
    conversation ending on a user turn gets that turn answered (and one ending on tool results gets them
    answered once). User turns before an assistant turn keep the one answer the source gives them. Derived from
    the row alone, so sample indices are the same on resume."""
    last = max((i for i, t in enumerate(turns) if t["role"] == "assistant"), default=-1)
    out = turns[: last + 1]
    for i, turn in enumerate(turns[last + 1 :], last + 1):
        out.append(turn)
        after = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if turn["role"] == "user" or (turn["role"] == "tool" and after != "tool"):
            out.append({"role": "assistant", "content": None})
    return out


#: the skip reason of a row whose tools or tool turns the chat template cannot render (--skip-bad-rows)
TOOLS_REFUSED = tool_turns.TOOLS_REFUSED
#: the skip reason of a row without a user turn (--skip-bad-rows)
NOTHING_TO_REGENERATE = "nothing to regenerate (no user turn answered)"


def plan(rows, skip_bad_rows: bool, tokenizer=None, keep=None) -> tuple[list[Conversation], dict]:
    """The conversations in the run's order with their sample indices; ``(plan, skipped by reason)``.

    ``rows``: ``(where, turns)`` or ``(where, ChatRow)`` (turns and tool definitions). A turn's role must be one
    the chat format knows (:func:`speculators_v016.run.turns.chat_role`); assistant turns before the first user turn
    are dropped (nothing asked them); user turns no assistant turn answers get an answer to generate
    (:func:`answer_slots`); a conversation without a user turn is a bad row (named, or skipped and counted with
    ``skip_bad_rows``, by reason), and so is one with tools or tool turns that ``tokenizer``'s chat template cannot
    render (:func:`tool_turns.template_refusal`). ``rows`` may be an iterator (read once); ``keep(number)``:
    whether conversation ``number`` keeps its turns and tools (None: all do; the others keep their facts only,
    so a shard's plan holds its own conversations' text, not the dataset's)."""
    out, skipped, index = [], {}, 0
    for where, raw in rows:
        chat = raw if isinstance(raw, tool_turns.ChatRow) else tool_turns.ChatRow(raw)
        try:
            turns = _turns_of(where, chat.turns)
            answers = sum(t["role"] == "assistant" for t in turns)
            if answers == 0:
                raise BadRowError(f"{where}: no user turn: nothing to regenerate", NOTHING_TO_REGENERATE)
            refusal = (
                tool_turns.template_refusal(tokenizer, turns, chat.tools)
                if tokenizer is not None and tool_turns.uses_tools(turns, chat.tools)
                else None
            )
            if refusal:
                raise BadRowError(f"{where}: {refusal}; --skip-bad-rows skips and counts such rows", TOOLS_REFUSED)
        except BadRowError as exc:
            if not skip_bad_rows:
                raise
            skipped[exc.reason] = skipped.get(exc.reason, 0) + 1
            continue
        facts = {
            "with_tools": tool_turns.uses_tools(turns, chat.tools),
            "unanswered": any(t["role"] == "assistant" and t["content"] is None for t in turns),
        }
        if keep is None or keep(len(out)):
            out.append(Conversation(len(out), where, turns, index, answers, chat.tools, **facts))
        else:
            out.append(Conversation(len(out), where, [], index, answers, None, **facts))
        index += answers
    return out, skipped


def _turns_of(where: str, raw: list[dict]) -> list[dict]:
    """A row's turns as the chat template takes them, with the answers to generate (:func:`answer_slots`)."""
    turns = []
    for turn in messages(where, raw):
        if turn["role"] == "assistant" and not any(t["role"] == "user" for t in turns):
            continue
        turns.append(turn)
    return answer_slots(turns)


@dataclass
class _Open:
    conversation: Conversation
    turn: int  # the assistant turn to generate next (0-based among the conversation's answers)
    history: list[dict] = field(default_factory=list)  # turns as the target's history so far
    prompt: list[int] | None = None  # the next turn's prompt ids, where already rendered
    folded: list[int] = field(default_factory=list)  # indices of turns folded into the next sample (not written)
    samples: int = 0  # samples of this conversation written or on their way
    end: int = -1  # the turns it has to generate: all its answers, fewer where it stopped at a tool call

    def __post_init__(self):
        if self.end < 0:
            self.end = self.conversation.answers


@dataclass
class Written:
    """What a resume checks the records it takes as history against: the samples the manifest lists.

    ``ids(index)``: the input ids of listed sample ``index`` (read from its file); ``holders``: the listed sample
    holding each folded turn, by index; ``offset``: index + offset is a sample's name (``--start-idx``)."""

    ids: Callable[[int], list[int]]
    holders: dict[int, int]
    offset: int = 0


class Regeneration:
    """The feed of a regenerating run: each conversation's next turn once its previous one is generated.

    ``feed()`` yields ``(index, prompt_ids, Generation)``, or None while every ready turn is out and the
    rest wait for a turn in flight; :meth:`complete` takes a generated turn and returns its record.
    ``done``: records of samples already written (a resume), by index: their turns are not generated again,
    their text is the history. A conversation whose prompt leaves no room for a new token is cut there.

    ``written`` (a resume): each record taken as history must still be what was written (:meth:`_check_record`):
    its text what its sampled ids decode to, and the prompt rendered from the history before it + its sampled ids
    what the listed sample holding it holds; else JournalError (the folder is refused). Without it (the unit
    tests' plans) records are taken as they are.
    """

    def __init__(
        self,
        tokenizer,
        conversations: list[Conversation],
        sampling: Sampling,
        stop_ids: frozenset[int],
        seq_length: int,
        done: dict[int, dict],
        start_idx: int = 0,
        logprobs_for=None,
        per_turn: bool = True,
        written: Written | None = None,
    ):
        self.tokenizer, self.sampling, self.stop_ids, self.seq_length = tokenizer, sampling, stop_ids, seq_length
        self.start_idx, self.logprobs_for = start_idx, logprobs_for or (lambda index: False)
        self.per_turn = per_turn
        self.written = written
        self.shapes: dict[str, int] = {}  # finished conversations by how their turns went into samples
        self.stops: dict[str, int] = {}  # conversations stopped at a tool call, by why
        self._ready: deque[_Open] = deque()
        self._out: dict[int, _Open] = {}
        self.cut: list[tuple[int, str]] = []  # (sample index, why) of turns that could not be generated
        for conv in conversations:
            self._ready.append(self._resume(conv, done))

    def _resume(self, conv: Conversation, done: dict[int, dict]) -> _Open:
        """The conversation from its first turn not yet written, with the written turns' text as history."""
        state = _Open(conv, 0)
        for turn in self._turns_until_answer(state):
            state.history.append(turn)
        while state.turn < state.end and (conv.first_index + state.turn + self.start_idx) in done:
            index = conv.first_index + state.turn + self.start_idx
            record = done[index]
            if record.get("in_later_sample"):  # its tokens are in the journal; its states come with a later turn
                prompt = self._prompt(state)
                holder = self.written.holders.get(index) if self.written is not None else None
                if record.get("prompt_sha256") != prompt_digest(prompt) and holder is None:
                    break  # generated under a history a killed run's resume has since regenerated: again
                self._check_record(index, record, prompt, holder)
                self._advance(state, record["text"])
                if not self._folds(state, prompt, record["token_ids"]):
                    raise regenerated.JournalError(
                        f"the {regenerated.JOURNAL} record of sample {index} says a later sample holds it, but "
                        "the chat template does not render the next prompt as its prompt + its sampled ids"
                    )
                state.folded.append(index)
            else:
                if self.written is not None:
                    prompt = state.prompt if state.prompt is not None else self._prompt(state)
                    self._check_record(index, record, prompt, index)
                if conv.uses_tools:  # the journal keeps every turn's sampled ids
                    self._check_call(state, index, record["token_ids"])
                self._advance(state, record["text"])
                state.prompt, state.folded, state.samples = None, [], state.samples + 1
        return state

    def _check_record(self, index: int, record: dict, prompt: list[int], holder: int | None) -> None:
        """A written turn's record, before a resume takes it as history: its text is what its sampled ids decode
        to; ``holder`` (the listed sample holding it, itself where it has its own file) holds ``prompt`` (rendered
        from the source and the turns before it as recorded) then the sampled ids, and a folded turn's
        ``prompt_sha256`` is that prompt's digest. JournalError naming the record where not: an edited record
        would prompt the next turns with text the target never wrote (or mask ids it did not sample)."""
        if self.written is None:
            return
        name = index + self.written.offset
        where = f"the {regenerated.JOURNAL} record of sample {name}"
        tokens = record.get("token_ids")
        if not isinstance(tokens, list) or record.get("text") != self.text_of_ids(tokens):
            raise regenerated.JournalError(
                f"{where}: its text is not what its sampled ids decode to (an edited record?); a resume would "
                "prompt the conversation's next turns with it: not a folder this tool wrote as it is"
            )
        if holder is None:
            return  # a folded turn no listed sample holds yet (a killed run's): its prompt's digest matched
        held = f"listed sample {holder + self.written.offset}"
        if record.get("in_later_sample") and record.get("prompt_sha256") != prompt_digest(prompt):
            raise regenerated.JournalError(
                f"{where}, a turn folded into {held}, no longer matches its digest: prompt_sha256 is not the digest "
                "of its prompt as rendered from the source and the turns before it as recorded (this record or an "
                "earlier one was edited): not a folder this tool wrote as it is"
            )
        ids, start = self.written.ids(holder), len(prompt)
        own = holder == index
        if (
            record.get("prompt_tokens") != start
            or ids[:start] != prompt
            or ids[start : start + len(tokens)] != tokens
            or (own and len(ids) != start + len(tokens))
        ):
            raise regenerated.JournalError(
                f"{where} does not match {held}: the file does not hold its prompt (rendered from the source and "
                "the turns before it as recorded) followed by its sampled ids (this record or an earlier one was "
                "edited): not a folder this tool wrote as it is"
            )

    def text_of_ids(self, token_ids: list[int]) -> str:
        """The text of sampled ids as a record keeps it (:meth:`text_of`)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _check_call(self, state: _Open, index: int, sampled: list[int]) -> dict | None:
        """Where turn ``state.turn`` (sample ``index``) calls other tools than its source turn did: the
        conversation stops after it (its later turns are cut, counted) and the stop, for its record."""
        conv = state.conversation
        if not conv.uses_tools:
            return None
        source = [t for t in conv.turns if t["role"] == "assistant"][state.turn]
        if source["content"] is None:  # no source answer to compare with
            return None
        text = self.tokenizer.decode(list(sampled), skip_special_tokens=False)
        expected = tool_turns.expected_names(source)
        try:
            stop = tool_turns.mismatch(expected, tool_turns.called_names(text))
        except tool_turns.CallsUnreadable as exc:  # bounded: the conversation stops here, named and counted
            stop = {"reason": tool_turns.UNREADABLE, "expected": expected, "got": None, "detail": str(exc)}
        if stop is None:
            return None
        stop["turn"] = state.turn
        state.end = state.turn + 1
        self.stops[stop["reason"]] = self.stops.get(stop["reason"], 0) + 1
        if stop["reason"] == tool_turns.UNREADABLE:
            why = (
                f"{regenerated.TOOL_UNREADABLE}: turn {state.turn} of {conv.where}: its calls cannot be read "
                f"({stop['detail']})"
            )
            logger.warning("{}; the conversation stops there (counted)", why)
        else:
            why = (
                f"{regenerated.TOOL_STOP}: turn {state.turn} of {conv.where} calls {stop['got']}, "
                f"the source's {stop['expected']}"
            )
        self.cut.extend((i, why) for i in range(index + 1, conv.first_index + conv.answers + self.start_idx))
        return stop

    def _folds(self, state: _Open, prompt: list[int], sampled: list[int]) -> bool:
        """Does the next turn's prompt (rendered here, kept in ``state``) start with ``prompt`` + ``sampled``, and
        leave room to generate it (a turn is folded only into a turn that will be generated)?"""
        if self.per_turn or state.turn >= state.end:
            return False
        state.prompt = self._prompt(state)
        before = list(prompt) + list(sampled)
        return state.prompt[: len(before)] == before and len(state.prompt) < self.seq_length

    def _turns_until_answer(self, state: _Open) -> list[dict]:
        """The source's non-assistant turns before assistant turn ``state.turn`` (after the previous one)."""
        out, answers = [], -1
        for turn in state.conversation.turns:
            if turn["role"] == "assistant":
                answers += 1
                if answers >= state.turn:
                    break
                continue
            if answers == state.turn - 1:
                out.append(turn)
        return out

    def _advance(self, state: _Open, text: str) -> None:
        """Turn ``state.turn`` answered with ``text``: into the history, then the next turn's source turns."""
        state.history.append({"role": "assistant", "content": text})
        state.turn += 1
        if state.turn < state.end:  # a stopped conversation's source turns after it are not its history
            state.history.extend(self._turns_until_answer(state))

    def feed(self) -> Iterator[tuple[int, list[int], Generation] | None]:
        while self._ready or self._out:
            if not self._ready:
                yield None
                continue
            state = self._ready.popleft()
            if state.turn >= state.end:
                continue
            index = state.conversation.first_index + state.turn + self.start_idx
            prompt = state.prompt if state.prompt is not None else self._prompt(state)
            state.prompt = prompt
            room = self.seq_length - len(prompt)
            cap = min(room, self.sampling.max_new_tokens or room)
            if cap < 1:  # this turn and the conversation's later ones (they would follow it)
                why = f"the prompt of turn {state.turn} has {len(prompt)} tokens, --seq-length {self.seq_length}"
                last = state.conversation.first_index + state.conversation.answers + self.start_idx
                self.cut.extend((i, why) for i in range(index, last))
                continue
            self._out[index] = state
            generation = Generation(
                max_new_tokens=cap,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                top_k=self.sampling.top_k,
                seed=sample_seed(self.sampling.seed, index),
                stop_token_ids=self.stop_ids,
                logprobs=bool(self.logprobs_for(index)),
            )
            yield index, prompt, generation

    def prompt_ids(self, history: list[dict], tools: list[dict] | None = None) -> list[int]:
        return regenerated.render_prompt(self.tokenizer, history, tools)

    def _prompt(self, state: _Open) -> list[int]:
        return self.prompt_ids(state.history, state.conversation.tools)

    def text_of(self, generated: Generated) -> str:
        """The turn's text as a server returns it: special tokens (the stop among them) left out."""
        return self.text_of_ids(generated.token_ids)

    def complete(self, index: int, generated: Generated) -> dict:
        """Sample ``index`` generated: its record (what the JSONL keeps), and its conversation's next turn queued."""
        state = self._out.pop(index)
        text = self.text_of(generated)
        prompt = state.prompt
        record = {
            "index": index,
            "source": state.conversation.where,
            "conversation": state.conversation.number,
            "turn": state.turn,
            "prompt_tokens": generated.prompt_len,
            "token_ids": generated.token_ids,
            "text": text,
            "finish_reason": generated.finish_reason,
            "seed": sample_seed(self.sampling.seed, index),
        }
        stop = self._check_call(state, index, generated.token_ids)
        if stop is not None:
            record["stop"] = stop
        self._advance(state, text)
        state.prompt = None
        if self._folds(state, prompt, generated.token_ids):
            record["in_later_sample"], record["prompt_sha256"] = True, prompt_digest(prompt)
            state.folded.append(index)
        else:
            if state.folded:
                record["earlier_turns"] = list(state.folded)
            self._count_shape(state, len(state.folded) + 1)
            state.folded = []
        self._ready.append(state)
        return record

    def _count_shape(self, state: _Open, turns_in_sample: int) -> None:
        """Count a finished conversation by how its generated turns went into samples."""
        state.samples += 1
        if state.turn < state.end:  # not finished
            return
        if state.end == 1:
            shape = "one turn"
        elif state.samples == 1 and turns_in_sample == state.end:
            shape = "one sample"
        elif state.samples == state.end:
            shape = "one sample per turn"
        else:
            shape = "split"
        self.shapes[shape] = self.shapes.get(shape, 0) + 1


def records_by_conversation(
    records: dict[int, dict], conversations: list[Conversation], sampling: Sampling, start_idx: int = 0
) -> list[dict[str, Any]]:
    """The regenerated conversations, one JSON object each, in the run's order (only turns written);
    ``records`` by sample name (index + ``start_idx``)."""
    out: list[dict[str, Any]] = []
    holder = {e: name for name, r in records.items() for e in r.get("earlier_turns", ())}
    for conv in conversations:
        answers = [records.get(conv.first_index + t + start_idx) for t in range(conv.answers)]
        if not any(answers):
            continue
        turns, answer, stop = [], 0, None
        for turn in conv.turns:
            if turn["role"] != "assistant":
                turns.append({k: v for k, v in turn.items() if k in ("role", "content", "tool_call_id", "name")})
                continue
            record = answers[answer]
            answer += 1
            if record is None:
                break
            turn = {"role": "assistant", "content": record["text"], "finish_reason": record["finish_reason"]}
            if record.get("in_later_sample"):  # its ids and mask are in the sample of a later turn
                turn["turn_index"] = record["index"]
            turn["sample"] = holder.get(record["index"], record["index"])
            turns.append(turn)
            stop = record.get("stop")
            if stop is not None:  # the source's turns after it (its tool results among them) are not kept
                break
        line = {"conversation": conv.number, "source": conv.where, "turns": turns, "sampling": sampling.as_dict()}
        if conv.tools:
            line["tools"] = conv.tools
        if stop is not None:
            line["stopped"] = {**stop, "kept_turns": len(turns), "source_turns": len(conv.turns)}
        out.append(line)
    return out


#: what data_config.json says of conversations with tools (the fingerprint holds it)
TOOL_TURNS = (
    "tool definitions passed to the chat template (tools=), tool results kept; a conversation stops after a turn "
    "whose calls differ from the source's (its tool results and later turns not generated, counted)"
)

#: what data_config.json says of the samples (the fingerprint holds it: a folder keeps its way)
PER_TURN = "one per generated turn (prompt: the history as regenerated, by the chat template)"
FOLDED = (
    "one per run of turns the chat template renders as prefixes of the next prompt, token for token (a whole "
    "conversation where it does), loss_mask 1 on every sampled id; else one per generated turn"
)


class RegenerationWork:
    """A ``--regenerate`` run's samples: planned from the rows, generated by the engine, recorded as text.

    The pipeline's side of this module: :meth:`prepare` (the plan, the sampling, the target's checks,
    before the engine starts), :meth:`begin` (the journal and the feed, after the resume check),
    :meth:`finish` (a generated sample's mask, record and vLLM's logprobs), :meth:`end` (the
    conversations file).
    """

    kind = "conversations"

    def __init__(
        self, tokenizer, conversations, sampling, stop_ids, seq_length, sources, skipped, start_idx, per_turn=True
    ):
        self.tokenizer, self.conversations, self.sampling = tokenizer, conversations, sampling
        self.stop_ids, self.seq_length, self.sources, self.skipped = stop_ids, seq_length, sources, skipped
        self.start_idx, self.truncated = start_idx, 0
        self.per_turn = per_turn
        self.count = sum(c.answers for c in conversations)
        self.regeneration: Regeneration | None = None
        self.journal = None
        self.records: dict[int, dict] = {}  # by sample name: this folder's, read at begin, then this run's
        self.finish_reasons: dict[str, int] = {}
        self._cut_seen = 0
        self._stops_found: dict[str, int] = {}  # by cut_without_engine (no engine: no regeneration)

    @classmethod
    def prepare(cls, opts, tokenizer, progress=None) -> RegenerationWork:
        """The plan of every row (each conversation's sample indices follow from the ones before it, so every row
        is read, into an index: :mod:`speculators_v016.run.row_index`; then again, one at a time, in the run's
        order); only this shard's conversations keep their turns. No row is tokenized here but for a tool row's
        template check. ``progress(bytes, rows)``: a bar's, while the rows are indexed."""
        index = build_index(
            list(opts.train_data_path),
            opts.skip_bad_rows,
            opts.hf_cache_dir,
            reader=tool_turns.read_chat,
            keep_duplicates=opts.keep_duplicate_rows,
            progress=progress,
        )
        try:
            return cls._planned(opts, tokenizer, index)
        finally:
            index.close()

    @classmethod
    def _planned(cls, opts, tokenizer, index) -> RegenerationWork:
        kind, sources, skipped = index.kind, index.descriptions, Counter(index.skipped)
        if kind != "conversations":
            raise BadRowError(
                "--regenerate needs conversations: pre-tokenized rows (input_ids) have no turns to answer"
            )
        check_generation_prompt(tokenizer)
        sampling = resolve_sampling(
            opts.engine.model, opts.temperature, opts.top_p, opts.top_k, opts.max_new_tokens, opts.seed
        )
        picked = index.iter_rows(run_order(len(index), opts.seed, opts.max_samples))
        shards, mine = opts.num_shards, opts.shard_index
        conversations, more_skipped = plan(picked, opts.skip_bad_rows, tokenizer, lambda n: n % shards == mine)
        for reason, n in more_skipped.items():
            skipped[reason] += n
        stop_ids = stop_token_ids(tokenizer, opts.engine.model)
        per_turn = opts.regenerate_samples == "turn"
        return cls(
            tokenizer, conversations, sampling, stop_ids, opts.seq_length, sources, skipped, opts.start_idx, per_turn
        )

    def describe(self) -> dict:
        """What data_config.json and the fingerprint record of the regeneration. ``unanswered_user_turns``
        only where the dataset has user turns no source answer follows: earlier releases planned no sample for
        them, so the sample indices of such a dataset differ and a folder of theirs must not be resumed (the
        fingerprint differs, naming it); the plan of every other dataset, and its folders, are as before."""
        described = {
            "on_policy": True,
            "sampling": self.sampling.as_dict(),
            "stop_token_ids": sorted(self.stop_ids),
            "samples": PER_TURN if self.per_turn else FOLDED,
            "conversations_file": "regenerated.jsonl",
            "rows_read": READ_RULES,  # a folder of rows read otherwise (an earlier release's) is not resumed
        }
        if any(
            c.unanswered or any(t["role"] == "assistant" and t["content"] is None for t in c.turns)
            for c in self.conversations
        ):
            described["unanswered_user_turns"] = "answered, in order (one sample each)"
        if any(c.with_tools or c.uses_tools for c in self.conversations):  # earlier releases refused or skipped them
            described["tool_turns"] = TOOL_TURNS
        return described

    def shard(self, num_shards: int, shard_index: int) -> list[int]:
        """This shard's sample indices: whole conversations (a turn needs the one before it)."""
        return [
            c.first_index + t
            for c in self.conversations
            if c.number % num_shards == shard_index
            for t in range(c.answers)
        ]

    def begin(self, directory: Path, pending: list[int], done: dict, logprobs_for) -> None:
        journal = regenerated.read_journal(directory)
        names = {int(name) for name in done}
        missing = sorted(names - set(journal))
        if missing:
            raise regenerated.JournalError(
                f"{directory}: samples {missing[:5]} are listed in manifest.jsonl but "
                f"{regenerated.JOURNAL} has no record of them: not a folder this tool wrote as it is"
            )
        untold = sorted(n for n in names if not isinstance(journal[n].get("text"), str))
        if untold:
            raise regenerated.JournalError(
                f"{directory}: the {regenerated.JOURNAL} records of samples {untold[:5]} hold no text: not a folder "
                "this tool wrote as it is"
            )
        self.records = {name: journal[name] for name in names}
        self.records.update(_folded_records(journal, names))
        self.regeneration = self._resumed(directory, pending, done, self.records, logprobs_for)
        self.journal = regenerated.Journal(directory)

    def _resumed(self, directory: Path, pending: list[int], done: dict, records: dict, logprobs_for=None):
        """The Regeneration of ``pending``'s conversations, the written turns' ``records`` (by name) their history,
        each checked against the listed sample holding it (:meth:`Regeneration._check_record`)."""
        names = {int(name) for name in done}
        by_index = {name - self.start_idx: record for name, record in records.items()}
        holders = {
            turn - self.start_idx: name - self.start_idx
            for name in names
            for turn in regenerated.folded_into([name], records)
        }

        def ids(index: int) -> list[int]:
            path = directory / done[index + self.start_idx].file
            try:
                return read_input_ids(path)
            except Exception as exc:  # noqa: BLE001 - any unreadable file is named, and the folder refused
                raise regenerated.JournalError(
                    f"{path}: cannot be read to check the history a resume takes from it ({type(exc).__name__}: "
                    f"{str(exc)[:200]})"
                ) from exc

        mine = set(map(int, pending))
        convs = [c for c in self.conversations if any(c.first_index + t in mine for t in range(c.answers))]
        return Regeneration(
            self.tokenizer,
            convs,
            self.sampling,
            self.stop_ids,
            self.seq_length,
            by_index,
            logprobs_for=logprobs_for,
            per_turn=self.per_turn,
            written=Written(ids, holders, self.start_idx),
        )

    def settled(self, directory: Path, done: dict) -> set[int]:
        """Sample names with no file of their own that are done: turns folded into a listed sample."""
        return regenerated.folded_into({int(name) for name in done}, regenerated.read_journal(directory))

    def cut_without_engine(self, directory: Path, pending: list[int], done: dict) -> list[tuple[int, str]] | None:
        """``pending``'s turns with why, if not one of them can be generated (each prompt, with the written turns'
        text as history, leaves no room under --seq-length: a finished run run again); None where the engine has
        a turn to generate. Tokenizes each pending conversation's next prompt; starts nothing."""
        journal = regenerated.read_journal(directory)
        names = {int(name) for name in done}
        if names - set(journal) or any(not isinstance(journal[n].get("text"), str) for n in names):
            return None  # begin() names that folder
        records = {name: journal[name] for name in names}
        records.update(_folded_records(journal, names))
        trial = self._resumed(directory, pending, done, records)
        for _turn in trial.feed():
            return None
        self._stops_found = dict(trial.stops)
        return trial.cut

    def feed(self, pending: list[int]):
        return self.regeneration.feed()

    def tokens(self, pending: list[int]) -> int | None:
        return None  # not known before the target has written them

    def finish(self, index: int, ids: list[int], engine) -> tuple[torch.Tensor | None, dict, list[float] | None]:
        """Sample ``index`` generated: its loss mask (1 on the sampled ids, its own and those of the turns folded
        into it), its record, vLLM's logprobs. A turn folded into a later sample: mask None (nothing to write)."""
        generated = engine.generated.pop(index)
        record = self.regeneration.complete(index, generated)
        record["index"] = index + self.start_idx
        if "earlier_turns" in record:
            record["earlier_turns"] = [i + self.start_idx for i in record["earlier_turns"]]
        self.records[record["index"]] = record
        self.finish_reasons[generated.finish_reason] = self.finish_reasons.get(generated.finish_reason, 0) + 1
        if record.get("in_later_sample"):
            return None, record, None
        mask = torch.zeros(len(ids), dtype=torch.long)
        mask[generated.prompt_len :] = 1
        for earlier in record.get("earlier_turns", ()):
            turn = self.records[earlier]
            mask[turn["prompt_tokens"] : turn["prompt_tokens"] + len(turn["token_ids"])] = 1
        return mask, record, generated.logprobs

    @property
    def stops(self) -> dict[str, int]:
        """This run's conversations stopped at a tool call, by why (a resume counts those it took up again)."""
        return dict(self.regeneration.stops) if self.regeneration is not None else dict(self._stops_found)

    @property
    def shapes(self) -> dict[str, int]:
        """This run's finished conversations by how their turns went into samples."""
        return dict(self.regeneration.shapes) if self.regeneration is not None else {}

    def take_cut(self) -> list[tuple[int, str]]:
        """Turns that could not be generated since the last call (their prompt left no room): (index, why)."""
        cut = self.regeneration.cut[self._cut_seen :]
        self._cut_seen = len(self.regeneration.cut)
        return cut

    def end(self, directory: Path, listed: set[int]) -> None:
        """The journal closed, and ``regenerated.jsonl`` written from the records of the ``listed`` samples."""
        if self.journal is not None:
            self.journal.close()
        records = {name: r for name, r in self.records.items() if name in listed}
        held = regenerated.folded_into(listed, self.records)
        records.update({name: self.records[name] for name in held if name in self.records})
        lines = records_by_conversation(records, self.conversations, self.sampling, self.start_idx)
        regenerated.write_conversations(directory, lines)


def _folded_records(records: dict[int, dict], listed) -> dict[int, dict]:
    """The records of folded turns that are not ``listed`` samples: their tokens are journaled, their states come
    with a later turn's sample (a resume goes on after them, where their prompts are still the history's)."""
    return {
        name: r
        for name, r in records.items()
        if name not in listed and r.get("in_later_sample") and isinstance(r.get("text"), str)
    }
