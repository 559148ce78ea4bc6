"""The zoo table (docs/vllm016-zoo.md/.json) as committed: every class classified with a reason, the capture's
names, no stale claim. (Regenerated from the installed vLLM and compared: tests/distribution/test_vllm_zoo_drift.py.)
"""

import json
import sys
from pathlib import Path

from speculators_v016.testing.tiny_models import ARCHITECTURES
from speculators_v016.worker import aux_outputs

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import vllm_zoo  # noqa: E402


def test_every_class_is_classified_with_a_reason():
    """No row without a status in {tested, start-up proof, refused, n/a} and a reason."""
    rows = json.loads(vllm_zoo.TABLE_JSON.read_text())["classes"]
    assert len(rows) > 150
    assert {r["status"] for r in rows.values()} == {"tested", "start-up proof", "refused", "n/a"}
    assert all(r["reason"] for r in rows.values())
    assert rows["commandr.CohereDecoderLayer"]["stream"].startswith("residual overwritten before use")
    assert rows["gpt_neox.GPTNeoXLayer"]["stream"] == "whole stream (one tensor)"
    assert rows["llama.LlamaDecoderLayer"]["stream"] == "fused add-norm: stream = hidden_states + residual"


def test_the_table_knows_the_names_the_capture_uses():
    """The decoder, layer-list and final-norm names the table judges by are the capture's own."""
    assert (vllm_zoo.DECODER_NAMES, vllm_zoo.LAYERS_NAMES, vllm_zoo.NORM_NAMES) == (
        aux_outputs.DECODER_NAMES,
        aux_outputs.LAYERS_NAMES,
        aux_outputs.NORM_NAMES,
    )


def test_tested_rows_name_families_the_engine_tests_run():
    """Every 'tested' row names a family that tests/engine builds (no stale claim)."""
    rows = json.loads(vllm_zoo.TABLE_JSON.read_text())["classes"]
    tested = [r["reason"].split(" (")[0] for r in rows.values() if r["status"] == "tested"]
    families = {name.strip().split(" ")[0].rstrip(",") for reason in tested for name in reason.split(", ")}
    assert families <= set(ARCHITECTURES), families - set(ARCHITECTURES)
