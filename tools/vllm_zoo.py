#!/usr/bin/env python3
"""Classify every decoder-layer class of the installed vLLM's model zoo: how the residual stream arrives.

Reads ``vllm/model_executor/models/*.py`` of the installed (pinned) vLLM by
AST, without importing it, and finds every layer class: those a layer stack
is built from (``make_layers(...)`` or ``nn.ModuleList(...)``, through
lambdas, local factories, layer-type tables and ``layer_type=`` arguments)
and every ``*DecoderLayer`` class. For each it derives from the source how the
stream reaches the layer (its ``forward``: a ``residual`` argument added by a
fused add-norm, overwritten before use as in a parallel block, or no such
argument: the stream whole; multipliers, sandwich norms) and where its decoder
holds layers and final norm; then what our capture does with it:

* ``tested``: a tiny random model of the family runs on the CPU engine in
  tests/engine and matches transformers (the test is named);
* ``start-up proof``: a causal LM decoder our capture finds; it runs when the
  start-up stream proof (:mod:`speculators_v016.worker.stream_proof`) passes on
  the loaded model and is refused with the proof's finding otherwise; not run here;
* ``refused``: the capture refuses it, with the reason;
* ``n/a``: not a causal LM's decoder layer (vision/audio/text encoders,
  encoder-decoder models, draft and MTP heads, sub-blocks).

The table is written to ``docs/vllm016-zoo.md`` (and the same rows as JSON
next to it); tests/distribution/test_vllm_zoo_drift.py regenerates it from the installed vLLM
and fails when it differs, so a class vLLM adds or drops, or a changed
``forward``, cannot go unnoticed.

    python tools/vllm_zoo.py [--check]
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_MD = ROOT / "docs" / "vllm016-zoo.md"
TABLE_JSON = ROOT / "docs" / "vllm016-zoo.json"

# Kept in step with speculators_v016.worker.aux_outputs (a unit test checks they are equal).
DECODER_NAMES = ("model", "transformer", "gpt_neox", "backbone")
LAYERS_NAMES = ("layers", "h", "blocks")
NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f", "final_norm", "embedding_norm")

#: Families with an engine test against transformers: layer class -> test.
TESTED = {
    "llama.LlamaDecoderLayer": "llama (test_generator_llama, test_generator_architectures)",
    "qwen3.Qwen3DecoderLayer": "qwen3 (test_generator_architectures)",
    "qwen3_moe.Qwen3MoeDecoderLayer": "qwen3_moe (test_generator_architectures)",
    "mixtral.MixtralDecoderLayer": "mixtral (test_generator_architectures)",
    "deepseek_v2.DeepseekV2DecoderLayer": "deepseek_v2, deepseek_v3 (test_model_families)",
    "qwen2_moe.Qwen2MoeDecoderLayer": "qwen2_moe (test_model_families)",
    "glm4_moe.Glm4MoeDecoderLayer": "glm4_moe (test_model_families)",
    "phi3.Phi3DecoderLayer": "phi3 (test_model_families)",
    "olmo2.Olmo2DecoderLayer": "olmo2 (test_model_families)",
    "gemma2.Gemma2DecoderLayer": "gemma2 (test_model_families)",
    "gemma3.Gemma3DecoderLayer": "gemma3 (test_model_families)",
    "commandr.CohereDecoderLayer": "cohere, cohere2 (test_model_families)",
    "gpt_neox.GPTNeoXLayer": "gpt_neox (test_model_families)",
    "llama4.Llama4DecoderLayer": "llama4 (dense layers; test_model_families)",
    "ernie45_moe.Ernie4_5_MoeDecoderLayer": "ernie4_5_moe (test_model_families)",
    "exaone4.Exaone4DecoderLayer": "exaone4 (test_model_families; its final norm takes the stream alone)",
}

#: Decoder layers found by the capture that vLLM's CPU backend cannot run here: class -> what was tried.
NOT_RUN_HERE = {
    "qwen3_next.Qwen3NextDecoderLayer": "not run here: vLLM 0.16's CPU backend fails at load ('ValueError: too many values to unpack' in "
    "dispatch_cpu_unquantized_gemm, the gated delta net's 3-D conv weight) and its linear attention is "
    "Triton-only; on GPUs the start-up proof decides; layer replay tested on transformers' own states",
    "minimax_text_01.MiniMaxText01DecoderLayer": "not run here: on CPU the start-up proof passes (whole stream), then warm-up fails in the Triton "
    "lightning attention ('Found no NVIDIA driver'); on GPUs the start-up proof decides; layer replay tested "
    "on transformers' own states",
}

#: Decoder layers the capture refuses (beyond what the names decide): class -> reason.
REFUSED = {
    "gemma3n.Gemma3nDecoderLayer": "AltUp: the stream travels as several [tokens, hidden] predictions stacked "
    "in one 3-D tensor; the start-up proof finds no [tokens, hidden] argument",
    "iquest_loopcoder.LoopCoderDecoderLayer": "looped decoder: each layer runs several times per forward; the "
    "start-up proof refuses a layer that does not run once, in order",
    "ouro.OuroDecoderLayer": "looped decoder (universal transformer): layers run several times per forward; "
    "refused by the start-up proof",
    "zamba2.Zamba2HybridLayer": "expected to be refused by the start-up proof (not run here): its shared "
    "attention block also takes the embeddings (original_hidden_states) as a second "
    "[tokens, hidden] input, so no combination of its inputs is the stream alone",
}

#: Files whose layer classes belong to draft models, MTP heads or encoder-decoder models (not captured).
DRAFT_FILES = ("_eagle", "_mtp", "medusa", "mlp_speculator")
#: Words in a container's name marking an encoder-decoder model's decoder.
ENC_DEC_WORDS = ("Whisper", "Bart", "T5")


@dataclass
class LayerClass:
    """One layer class and what the table says about it."""

    name: str  # module.Class
    stacks: list[str] = field(default_factory=list)  # Container.attr
    params: list[str] = field(default_factory=list)  # forward parameters (without self)
    stream: str = ""
    notes: list[str] = field(default_factory=list)
    role: str = "decoder"
    status: str = ""
    reason: str = ""


class Zoo:
    """The parsed model files of one vLLM installation."""

    def __init__(self, models_dir: Path):
        self.trees = {f.stem: ast.parse(f.read_text()) for f in sorted(models_dir.glob("*.py"))}
        self.classes: dict[tuple[str, str], ast.ClassDef] = {}
        self._bases: dict[tuple[str, str], list[tuple[str, str]]] = {}
        self.imports: dict[str, dict[str, str]] = {m: {} for m in self.trees}
        for mod, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    self.classes[mod, node.name] = node
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module:
                    src = node.module.split(".")[-1]
                    local = node.level > 0 or node.module.startswith("vllm.model_executor.models")
                    if local and src in self.trees:
                        for alias in node.names:
                            self.imports[mod][alias.asname or alias.name] = src

    def resolve(self, mod: str, name: str) -> tuple[str, str] | None:
        if (mod, name) in self.classes:
            return mod, name
        src = self.imports[mod].get(name)
        return (src, name) if src and (src, name) in self.classes else None

    def bases(self, key: tuple[str, str]) -> list[tuple[str, str]]:
        """``key`` and its base classes defined in the models folder, nearest first."""
        if key in self._bases:
            return self._bases[key]
        out, todo = [], [key]
        while todo:
            cur = todo.pop(0)
            if cur in out:
                continue
            out.append(cur)
            for base in self.classes[cur].bases:
                name = ast.unparse(base).split(".")[-1].split("[")[0]
                found = self.resolve(cur[0], name)
                if found:
                    todo.append(found)
        self._bases[key] = out
        return out

    def method(self, key: tuple[str, str], name: str) -> tuple[tuple[str, str], ast.FunctionDef] | None:
        for owner in self.bases(key):
            for node in self.classes[owner].body:
                if isinstance(node, ast.FunctionDef) and node.name == name:
                    return owner, node
        return None

    # -- layer stacks --------------------------------------------------------------------
    def _refs(self, mod: str, expr: ast.AST, funcs: dict, tables: dict, params: dict, depth: int = 0) -> set:
        found: set[tuple[str, str]] = set()
        if depth > 3:
            return found
        for node in ast.walk(expr):
            if isinstance(node, ast.Name):
                if (hit := self.resolve(mod, node.id)) is not None:
                    found.add(hit)
                for table in (funcs, tables):
                    if node.id in table:
                        found |= self._refs(mod, table[node.id], funcs, tables, params, depth + 1)
                if params.get(node.id) is not None:
                    found |= self._refs(mod, params[node.id], funcs, tables, {}, depth + 1)
        return found

    def stacks(self) -> dict[tuple[str, str], dict[str, set]]:
        """Container class -> stack attribute -> layer classes built into it."""
        out: dict[tuple[str, str], dict[str, set]] = {}
        handed: list[tuple[str, str, ast.Call, ast.keyword, dict]] = []  # layer_type= arguments
        tables_of = {
            mod: {
                t.id: n.value
                for n in tree.body
                if isinstance(n, ast.Assign)
                for t in n.targets
                if isinstance(t, ast.Name)
            }
            for mod, tree in self.trees.items()
        }
        for (mod, cname), cdef in self.classes.items():
            tables = tables_of[mod]
            for fn in (n for n in cdef.body if isinstance(n, ast.FunctionDef)):
                nodes = list(ast.walk(fn))
                funcs: dict = {n.name: n for n in nodes if isinstance(n, ast.FunctionDef) and n is not fn}
                funcs |= {
                    t.id: n.value
                    for n in nodes
                    if isinstance(n, ast.Assign)
                    for t in n.targets
                    if isinstance(t, ast.Name)
                }  # local layer-class choices
                calls = [n for n in nodes if isinstance(n, ast.Call)]
                for n in calls:  # layers.append(...) into a local list
                    if (
                        isinstance(n.func, ast.Attribute)
                        and n.func.attr == "append"
                        and isinstance(n.func.value, ast.Name)
                    ):
                        listed = funcs.get(n.func.value.id)
                        funcs[n.func.value.id] = ast.List(
                            elts=[*(listed.elts if isinstance(listed, ast.List) else []), *n.args], ctx=ast.Load()
                        )
                args = fn.args
                defaults = [None] * (len(args.args) - len(args.defaults)) + list(args.defaults)
                params = {a.arg: d for a, d in zip(args.args, defaults)}
                params |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults)}
                handed += [
                    (mod, cname, n, kw, params)
                    for n in calls
                    for kw in n.keywords
                    if kw.arg in ("layer_type", "decoder_layer_type")
                ]
                for node in nodes:
                    if not isinstance(node, ast.Assign):
                        continue
                    target = node.targets[0]
                    attrs = [
                        t.attr
                        for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                        if isinstance(t, ast.Attribute)
                    ]
                    builds = any(
                        isinstance(c, ast.Call) and _callee(c) in ("make_layers", "ModuleList")
                        for c in ast.walk(node.value)
                    )
                    if attrs and builds:
                        refs = self._refs(mod, node.value, funcs, tables, params)
                        refs = {r for r in refs if self._is_layer(r)}
                        if refs:
                            out.setdefault((mod, cname), {}).setdefault(attrs[-1], set()).update(refs)
        # layer types handed on with ``layer_type=`` / ``decoder_layer_type=`` to a container, directly or
        # through the __init__ of a subclass or of a causal LM that forwards its own argument (to a fixpoint)
        forwards: dict[tuple[str, str], tuple[tuple[str, str], str]] = {c: (c, next(iter(a))) for c, a in out.items()}
        for _ in range(4):
            for mod, cname, node, kw, params in handed:
                target = self._container_called(mod, cname, node, forwards)
                if target is None:
                    continue
                container, attr = forwards[target]
                if isinstance(kw.value, ast.Name) and kw.value.id in params:
                    forwards.setdefault((mod, cname), (container, attr))
                refs = {r for r in self._refs(mod, kw.value, {}, {}, params) if self._is_layer(r)}
                if refs:
                    out.setdefault(container, {}).setdefault(attr, set()).update(refs)
        return out

    def _container_called(self, mod, cname, call: ast.Call, known: dict) -> tuple[str, str] | None:
        """The class in ``known`` that ``call`` builds: a base via ``super().__init__``, or ``SomeModel(...)``."""
        func = ast.unparse(call.func)
        if func.startswith("super(") and func.endswith("__init__"):
            return next((b for b in self.bases((mod, cname))[1:] if b in known), None)
        target = self.resolve(mod, func.split(".")[-1])
        if target is None:
            return None
        return next((b for b in self.bases(target) if b in known), None)

    def _is_layer(self, key: tuple[str, str]) -> bool:
        """A module class with a forward (not a config, norm or linear layer)."""
        name = key[1]
        if any(
            word in name
            for word in (
                "Config",
                "Norm",
                "Linear",
                "Embedding",
                "Head",
                "Rotary",
                "Attention",
                "MLP",
                "MoE",
                "Projector",
                "Merger",
                "Projection",
                "Adapter",
            )
        ):
            return name.endswith(("DecoderLayer", "Block", "Layer")) and "Norm" not in name
        return self.method(key, "forward") is not None

    # -- one layer class ---------------------------------------------------------------------
    def describe(self, key: tuple[str, str]) -> tuple[list[str], str, list[str]]:
        """Forward parameters, how the stream arrives, and notes (multipliers, sandwich norms, parallel)."""
        found = self.method(key, "forward")
        if found is None:
            return [], "no forward", []
        _, fn = found
        params = [a.arg for a in fn.args.args[1:]] + [a.arg for a in fn.args.kwonlyargs]
        body = ast.unparse(fn)
        notes = []
        if any(w in body for w in ("multiplier", "scale_depth", "_alpha", "_beta", "residual_scale")):
            notes.append("multipliers")
        if any(
            w in body
            for w in (
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
                "post_mlp_layernorm",
                "post_self_attn_layernorm",
                "post_attention_norm",
                "ffn_norm_post",
            )
        ):
            notes.append("sandwich norms")
        if "parallel" in body or "use_parallel_residual" in body:
            notes.append("parallel residual")
        residual = next((p for p in params if "residual" in p.lower()), None)
        if residual is None:
            return params, "whole stream (one tensor)", notes
        first = self._first_use(fn, residual)
        if first == "overwritten":
            return params, f"{residual} overwritten before use: stream = hidden_states alone", notes
        if first == "norm":
            return params, f"fused add-norm: stream = hidden_states + {residual}", notes
        return params, f"{residual} argument used otherwise ({first})", notes

    @staticmethod
    def _first_use(fn: ast.FunctionDef, residual: str) -> str:
        """How ``residual`` is first used in ``fn``: 'overwritten', 'norm' (handed to a norm), or the line."""

        def statements(body):
            for stmt in body:
                if isinstance(stmt, ast.If) and any(
                    isinstance(n, ast.Name) and n.id == residual for n in ast.walk(stmt.test)
                ):
                    # "if residual is None:" is the first layer's case: the other branch is every later layer's
                    test = stmt.test
                    none = (
                        isinstance(test, ast.Compare)
                        and isinstance(test.ops[0], (ast.Is, ast.IsNot))
                        and isinstance(test.comparators[0], ast.Constant)
                        and test.comparators[0].value is None
                    )
                    if none:
                        yield from statements(stmt.orelse if isinstance(test.ops[0], ast.Is) else stmt.body)
                        continue
                if isinstance(stmt, ast.If):
                    yield from statements(stmt.body)
                    yield from statements(stmt.orelse)
                    continue
                if isinstance(stmt, (ast.For, ast.While, ast.With)):
                    yield from statements(stmt.body)
                    continue
                yield stmt

        for stmt in statements(fn.body):
            if not any(isinstance(n, ast.Name) and n.id == residual for n in ast.walk(stmt)):
                continue
            for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                names = [a.id for a in call.args if isinstance(a, ast.Name)]
                names += [k.value.id for k in call.keywords if isinstance(k.value, ast.Name)]
                func = ast.unparse(call.func).split(".")[-1].lower()
                if residual in names and ("norm" in func or func.startswith("ln")):
                    return "norm"
            if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == residual for t in stmt.targets):
                if not any(isinstance(n, ast.Name) and n.id == residual for n in ast.walk(stmt.value)):
                    return "overwritten"
            return ast.unparse(stmt).splitlines()[0][:60]
        return "unused"

    def final_norm(self, container: tuple[str, str]) -> str | None:
        """The attribute of ``container`` (or a base) that our capture takes for the final norm, if any."""
        names = set()
        for owner in self.bases(container):
            for fn in (n for n in self.classes[owner].body if isinstance(n, ast.FunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Assign):
                        for t in node.targets:
                            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                                if (
                                    isinstance(el, ast.Attribute)
                                    and isinstance(el.value, ast.Name)
                                    and el.value.id == "self"
                                ):
                                    names.add(el.attr)
        hits = [n for n in NORM_NAMES if n in names]
        return hits[0] if hits else None


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def classify(zoo: Zoo) -> list[LayerClass]:
    stacks = zoo.stacks()
    rows: dict[tuple[str, str], LayerClass] = {}
    for container, attrs in stacks.items():
        for attr, layers in attrs.items():
            for key in layers:
                row = rows.setdefault(key, LayerClass(f"{key[0]}.{key[1]}"))
                row.stacks.append(f"{container[1]}.{attr}")
    for key in zoo.classes:
        if key[1].endswith("DecoderLayer") and key not in rows:
            rows[key] = LayerClass(f"{key[0]}.{key[1]}")
    parents: dict[tuple[str, str], set[str]] = {}  # layer-like class -> the layer classes that build it
    for key in rows:
        init = zoo.method(key, "__init__")
        for node in ast.walk(init[1]) if init else ():
            if isinstance(node, ast.Call):
                part = zoo.resolve(init[0][0], ast.unparse(node.func).split(".")[-1])
                if part is not None and part != key:
                    parents.setdefault(part, set()).add(key[1])
    for key, row in rows.items():
        row.stacks.sort()
        row.params, row.stream, row.notes = zoo.describe(key)
        containers = [(c, a) for c, attrs in stacks.items() for a, ls in attrs.items() if key in ls]
        if len({frozenset(stacks[c][a]) for c, a in containers if len(stacks[c][a]) > 1}):
            row.notes.append(
                "hybrid stack: "
                + ", ".join(sorted({f"{m}.{n}" for c, a in containers for m, n in stacks[c][a] if (m, n) != key}))
            )
        _judge(zoo, key, row, containers, parents)
    rows[("utils", "PPMissingLayer")] = LayerClass(
        "utils.PPMissingLayer",
        [],
        ["*args", "**kwargs"],
        "placeholder (identity)",
        [],
        "placeholder",
        "n/a",
        "stands in for the layers of other pipeline stages and is never called: each stage proves and taps the "
        "layers it holds (docs/pipeline-parallel.md)",
    )
    return sorted(rows.values(), key=lambda r: r.name.lower())


def _judge(zoo: Zoo, key: tuple[str, str], row: LayerClass, containers: list, parents: dict) -> None:
    mod, name = key
    if any(part in mod for part in DRAFT_FILES) or "Eagle" in name or "MTP" in name or "MultiTokenPredictor" in name:
        row.role, row.status = "draft head", "n/a"
        row.reason = "a draft model or MTP head (what the captured data trains), not a target's decoder"
        return
    if row.name in TESTED:
        row.status, row.reason = "tested", TESTED[row.name]
        return
    if row.name in REFUSED:
        row.status, row.reason = "refused", REFUSED[row.name]
        return
    decoders = [(c, a) for c, a in containers if _is_lm_decoder(zoo, c)]
    if not decoders:
        if not containers and key in parents:
            row.role, row.status = "sub-block", "n/a"
            row.reason = f"a part of {', '.join(sorted(parents[key]))} (the stack's layer), not a layer itself"
        elif not containers:
            row.role, row.status = "unused", "n/a"
            row.reason = "not built into any layer stack of the models folder (a base class or an alias)"
        elif any(w in c[1] and "Decoder" in c[1] for c, _ in containers for w in ENC_DEC_WORDS):
            row.role, row.status = "encoder-decoder", "n/a"
            row.reason = "a layer of an encoder-decoder model (its decoder attends to an encoder), not a causal LM"
        else:
            row.role, row.status = "encoder", "n/a"
            row.reason = "a layer of a vision, audio or text encoder, not of a causal LM's decoder"
        return
    where = []
    for container, attr in decoders:
        norm = zoo.final_norm(container)
        if attr not in LAYERS_NAMES or norm is None:
            where.append(
                f"{container[1]} holds its layers in .{attr} and "
                + (f"its final norm in .{norm}" if norm else "no final norm the capture knows")
            )
    if where and len(where) == len(decoders):
        row.status = "refused"
        row.reason = "cannot find the decoder layers: " + "; ".join(where)
        return
    row.status = "start-up proof"
    row.reason = NOT_RUN_HERE.get(
        row.name, "not run here; runs when the start-up stream proof passes on the loaded model, refused otherwise"
    )


def _is_lm_decoder(zoo: Zoo, container: tuple[str, str]) -> bool:
    """A container of a causal LM's decoder: builds a token embedding, or its layers are the LM's (known exceptions)."""
    if any(w in container[1] for w in ("Encoder", "Vision", "Audio", *ENC_DEC_WORDS)):
        return False
    for key in zoo.bases(container):
        if any(
            isinstance(n, ast.Call) and _callee(n) in ("VocabParallelEmbedding", "Embedding")
            for n in ast.walk(zoo.classes[key])
        ):
            return True
    # decoders whose token embedding sits one level up (ChatGLM, PLaMo)
    return container[1] in {"GLMTransformer", "Plamo2Decoder", "Plamo3Decoder"}


def render_markdown(rows: list[LayerClass], vllm_version: str) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.status] = counts.get(r.status, 0) + 1
    lines = [
        f"# vLLM {vllm_version} model zoo: decoder-layer classes and the capture",
        "",
        "Generated by `python tools/vllm_zoo.py` from the installed vLLM's `model_executor/models/*.py` (AST, no",
        "import); `tests/distribution/test_vllm_zoo_drift.py` regenerates it and fails when it differs. Status: **tested** (a",
        "tiny random model on the CPU engine matches transformers; test named), **start-up proof** (found by the",
        "capture; runs when the stream proof on the loaded model passes, refused with its finding otherwise; not",
        "run here), **refused** (with the reason), **n/a** (not a causal LM's decoder layer). The stream column is",
        "read from each class's `forward` source; at run time the start-up proof decides from the layer's behaviour.",
        "",
        "Counts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ".",
        "",
        "| class | stack | stream (from the source) | notes | status | reason |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [f"`{r.name}`", ", ".join(r.stacks) or "-", r.stream, "; ".join(r.notes) or "-", r.status, r.reason]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def installed_models_dir() -> tuple[Path, str]:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise SystemExit("vllm is not installed")
    root = Path(spec.origin).parent
    version = "unknown"
    version_file = root / "_version.py"
    if version_file.exists():
        found = re.search(r"^__version__\b.*?['\"]([^'\"]+)['\"]", version_file.read_text(), re.M)
        version = found.group(1) if found else version
    return root / "model_executor" / "models", version


def generate() -> tuple[str, str]:
    """(markdown, json) of the installed vLLM's zoo."""
    models, version = installed_models_dir()
    rows = classify(Zoo(models))
    data = {"vllm": version, "classes": {r.name: {k: v for k, v in asdict(r).items() if k != "name"} for r in rows}}
    return render_markdown(rows, version), json.dumps(data, indent=1, sort_keys=True) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed table differs (write nothing)")
    args = ap.parse_args()
    markdown, data = generate()
    if args.check:
        same = TABLE_MD.exists() and TABLE_MD.read_text() == markdown and TABLE_JSON.read_text() == data
        print("up to date" if same else f"{TABLE_MD} differs from the installed vLLM: run tools/vllm_zoo.py")
        return 0 if same else 1
    TABLE_MD.parent.mkdir(exist_ok=True)
    TABLE_MD.write_text(markdown)
    TABLE_JSON.write_text(data)
    print(f"wrote {TABLE_MD} and {TABLE_JSON}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
