"""bench/report.py: the tables of required cases, the generated sections of BENCHMARK_H200.md, record merging."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import report  # noqa: E402
from cases import DECODE_NS, PREFILL_REQUIRED_MS, PREFILL_ROWS, PREFILL_SM80_ROW, decode_case  # noqa: E402


def _rec(case, impl, ms, floor=0.1, **extra):
    return dict(case=case, impl=impl, median_ms=ms, floor_ms=floor, date="2026-11-29", gpu="NVIDIA H200", **extra)


def test_prefill_table_marks_met_and_missing():
    fast, slow = list(PREFILL_ROWS)[:2]
    recs = [_rec(fast, "flashkda", PREFILL_REQUIRED_MS[fast] - 0.01), _rec(slow, "flashkda", 9.0),
            _rec(fast, "fla_chunk_kda", 2.5)]
    lines = {line.split(" | ")[0][2:]: line for line in report.prefill_table(recs).splitlines()[2:]}
    assert lines[fast].endswith("| yes |") and "2.500" in lines[fast]
    assert lines[slow].endswith("| no |")
    assert all(line.endswith("| — |") for case, line in lines.items() if case not in (fast, slow))


def test_prefill_table_checks_the_other_bounds():
    first, other = list(PREFILL_ROWS)[:2]
    recs = [_rec(first, "flashkda", 1.0), _rec(first, "flashkda_softplus", 1.25), _rec(first, "flashkda_gdn", 1.7),
            _rec(first, "fla_chunk_gdn", 1.6), _rec(first, "flashkda_sm80", 1.5), _rec(first, "fla_chunk_kda", 2.6),
            _rec(other, "flashkda", 1.0), _rec(other, "flashkda_softplus", 1.4)]
    lines = {line.split(" | ")[0][2:]: line for line in report.prefill_table(recs).splitlines()[2:]}
    assert first == PREFILL_SM80_ROW
    assert "softplus 1.25× yes; GDN ≤ FLA GDN no; sm80 ≤ FLA chunk_kda yes" in lines[first]
    assert "softplus 1.40× no; GDN ≤ FLA GDN —" in lines[other] and "sm80" not in lines[other]


def test_decode_table_checks_the_bf16_pool_bound_and_host_overhead():
    recs = [_rec(decode_case(N), "flashkda", 0.001, host_overhead_us=5.0) for N in DECODE_NS]
    recs.append(_rec(decode_case(256), "flashkda_bf16pool", 0.2))
    text = report.decode_table(recs)
    row256 = next(line for line in text.splitlines() if line.startswith(f"| {decode_case(256)} "))
    assert row256.endswith("| yes / no |") and "5.0 (≤ 20)" in row256


def test_update_markdown_replaces_only_its_section(tmp_path):
    md = tmp_path / "B.md"
    md.write_text("# title\n\nhand-written\n")
    report.update_markdown(str(md), "prefill", "first\n")
    report.update_markdown(str(md), "decode", "other\n")
    report.update_markdown(str(md), "prefill", "second\n")
    doc = md.read_text()
    assert doc.startswith("# title\n\nhand-written\n")
    assert "second" in doc and "first" not in doc and doc.count("<!-- report:prefill -->") == 1
    assert "other" in doc


def test_section_names_command_date_and_gpu():
    case = list(PREFILL_ROWS)[0]
    text = report.section("prefill", [_rec(case, "flashkda", 1.0)], "bash bench/h200_run.sh prefill")
    assert "`bash bench/h200_run.sh prefill`" in text and "2026-11-29" in text and "NVIDIA H200" in text
    assert report.section("decode", [_rec(case, "flashkda", 1.0)], "x") == ""


def test_update_sections_leaves_the_other_sections(tmp_path):
    """Updating one kind of section keeps the others, and the commands they name, as they were."""
    md = tmp_path / "B.md"
    prefill_case = list(PREFILL_ROWS)[0]
    recs = [_rec(prefill_case, "flashkda", 1.0), _rec(decode_case(256), "flashkda", 0.1)]
    report.update_sections(str(md), recs, "prefill command")
    report.update_sections(str(md), recs, "decode command", kinds=("decode",))
    doc = md.read_text()
    assert "`prefill command`" in doc.split("<!-- report:decode -->")[0]
    assert "`decode command`" in doc.split("<!-- report:decode -->")[1]
    assert doc.count("prefill command") == 1 and doc.count("decode command") == 1


def test_merge_replaces_same_case_and_impl(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps([_rec("a", "x", 1.0), _rec("a", "y", 2.0)]))
    merged = report.merge_records(str(path), [_rec("a", "x", 3.0), _rec("b", "x", 4.0)])
    got = {(r["case"], r["impl"]): r["median_ms"] for r in merged}
    assert got == {("a", "x"): 3.0, ("a", "y"): 2.0, ("b", "x"): 4.0}
    assert json.loads(path.read_text()) == merged
