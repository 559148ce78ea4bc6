"""The architecture table is rendered from the tests' results; rows no test of this run measured stay as they were."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _table():
    spec = importlib.util.spec_from_file_location("architecture_table", ROOT / "tools" / "architecture_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def result(name: str, note: str) -> dict:
    return dict(device="cpu", name=name, model_class="X", aux_source="taps", tested="engine", max_abs_error=1e-6,
                tolerance=1e-5, note=note, dtype="float32")  # fmt: skip


def test_a_row_this_run_did_not_measure_is_kept_and_a_measured_one_replaced():
    """An AVX512-only row survives an AVX2 run; a family measured again gets its new figures; order by name."""
    table = _table()
    old = table.rows({"llama": result("llama", "old"), "zeta awq": result("zeta awq", "avx512 only")})
    page = "\n".join(["intro", table.BEGIN, *old, table.END, "outro"])
    new = table.keep_unmeasured(table.rows({"llama": result("llama", "new"), "alpha": result("alpha", "a")}), page)
    names = [table._name(line) for line in new[2:]]
    assert names[:3] == ["alpha", "llama", "zeta awq"] and names[3:] == sorted(table.NOT_RUN)
    assert "| new |" in new[3] and "avx512 only" in new[4]
    assert table.keep_unmeasured(new, "\n".join([table.BEGIN, *new, table.END])) == new


def test_families_run_under_pipeline_parallelism_get_a_table_of_their_own():
    """Results recorded as cpu-pp-* become the pipeline table's rows (one per layout), never rows of the main table."""
    table = _table()
    pp = dict(result("llama", "bit for bit"), device="cpu-pp-pp2", tested="PP 2", max_abs_error=0.0)
    tp_pp = dict(result("llama", "reduction order"), device="cpu-pp-tp2pp2", tested="TP 2 x PP 2", max_abs_error=2e-6)
    results = {"llama": result("llama", "fp32"), "llama@cpu-pp-pp2": pp, "llama@cpu-pp-tp2pp2": tp_pp}
    lines = table.pipeline_rows(results)
    assert [line.split("|")[4].strip() for line in lines[2:]] == ["PP 2", "TP 2 x PP 2"]
    assert "| 0.0e+00 | bit for bit |" in lines[2] and "2.0e-06" in lines[3]
    assert [table._name(line) for line in table.rows(results)[2:]] == ["llama"] + sorted(table.NOT_RUN)


def test_a_case_run_on_the_gpu_only_gets_a_row_of_its_own():
    """A GPU result under a name of its own (MLA across steps) is a row with the GPU column; a family's stays its cell."""
    table = _table()
    gpu = {
        "deepseek_v3@bfloat16@cuda-eager": dict(result("deepseek_v3", "rows: median 1e-02"), device="cuda-eager",
                                                dtype="bfloat16", model_class="DeepseekV3ForCausalLM"),
        "deepseek_v3 (MLA across steps)@bfloat16@cuda-compiled": dict(
            result("deepseek_v3 (MLA across steps)", "rows: median 2e-02, MLA across steps"), device="cuda-compiled",
            dtype="bfloat16", model_class="DeepseekV3ForCausalLM"),
    }  # fmt: skip
    lines = table.rows({"deepseek_v3": result("deepseek_v3", "fp32")}, gpu)
    names = [table._name(line) for line in lines[2:]]
    assert names == ["deepseek_v3", "deepseek_v3 (MLA across steps)"] + sorted(table.NOT_RUN)
    assert "eager: rows: median 1e-02" in lines[2] and "MLA across steps" not in lines[2]
    cells = [cell.strip() for cell in lines[3].split("|")[1:-1]]
    assert cells == ["deepseek_v3 (MLA across steps)", "`DeepseekV3ForCausalLM`", "taps", "GPU only", "-", "-", "-",
                     "compiled: rows: median 2e-02, MLA across steps", ""]  # fmt: skip
    page = "\n".join([table.BEGIN, *lines, table.END])
    assert table.keep_unmeasured(lines, page) == lines
