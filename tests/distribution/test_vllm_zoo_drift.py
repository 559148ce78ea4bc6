"""The zoo table (docs/vllm016-zoo.md/.json) is in step with the installed, pinned vLLM's model files.

tools/vllm_zoo.py reads every file of vllm/model_executor/models by AST; a layer
class vLLM adds or drops, a changed forward signature, or a changed
classification makes the regenerated table differ from the committed one.
(Here, not in tests/unit: parsing vLLM's ~240 model files takes 5-10 s of CPU.)
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import vllm_zoo  # noqa: E402


def test_zoo_table_matches_the_installed_vllm():
    """Regenerating the table from the installed vLLM gives the committed files exactly; a drift names its classes."""
    markdown, data = vllm_zoo.generate()
    committed = json.loads(vllm_zoo.TABLE_JSON.read_text())
    fresh = json.loads(data)
    added = sorted(set(fresh["classes"]) - set(committed["classes"]))
    dropped = sorted(set(committed["classes"]) - set(fresh["classes"]))
    changed = sorted(
        k for k in set(fresh["classes"]) & set(committed["classes"]) if fresh["classes"][k] != committed["classes"][k]
    )
    assert (added, dropped, changed) == ([], [], []), (
        f"run tools/vllm_zoo.py: added {added}, dropped {dropped}, changed {changed}"
    )
    assert fresh["vllm"] == committed["vllm"] == "0.16.0"
    assert data == vllm_zoo.TABLE_JSON.read_text() and markdown == vllm_zoo.TABLE_MD.read_text()
