"""`specdec bench` end to end on tiny models: the report's structure, and the greedy
equality check, which passes on the real services and fails on a corrupted verifier."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from bench.benchmark import BenchConfig, run_bench
from bench.load import CHOICE_NAMES
from bench.load_sweep import POLICIES, SweepConfig, run_sweep, write
from bench.report import AUTO, TARGET_ONLY

TEMPERATURES = (0.0, 0.8)
LENGTHS = (8, 24)


def tiny_config(toy, out) -> BenchConfig:
    return BenchConfig(
        target=str(toy.target), draft=str(toy.close), prompts=2, lengths=LENGTHS, temperatures=TEMPERATURES,
        ks=(2, 3), repeats=1, verify_threads=1, peer_threads=1, calibration_length=16, mismatched_length=48,
        short_repeats=1, mismatched_repeats=1, in_flight=(1, 4), load_tokens=24, out=out,
    )  # fmt: skip


def test_quick_bench_reports_every_cell_and_passes_the_greedy_check(toy, tmp_path):
    config = tiny_config(toy, tmp_path / "out")
    result = run_bench(config)

    assert json.loads(json.dumps(result)) == json.loads((config.out / "bench.json").read_text())
    assert (config.out / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (config.out / "bench.md").read_text()
    load = {(row["in_flight"], row["mode"]): row for row in result["in_flight"]}
    assert set(load) == {(n, mode) for n in (1, 4) for mode in ("target-only", "on-k4", "auto")}
    assert all(row["tokens_per_s"] > 0 and row["ttft_ms"]["p99"] >= row["ttft_ms"]["p50"] > 0 for row in load.values())
    assert "| 4 | on-k4 |" in table
    assert "| T | tokens | target-only | auto | k=2 | k=3 | generate | assisted-default | assisted-constant |" in table
    assert result["greedy_failures"] == [] and "all speculative completions equal target-only" in table

    cells = {(c["temperature"], c["length"], c["column"]): c for c in result["cells"]}
    assert set(cells) == {(t, n, col) for t in TEMPERATURES for n in LENGTHS for col in config.columns}
    for (t, n, column), cell in cells.items():
        assert cell["runs"] == 2 and cell["tokens_per_s"] > 0
        if column == TARGET_ONLY:
            assert cell["speedup"] == 1.0 and cell["acceptance_rate"] == 0.0
        if column == AUTO:  # whether these short outputs open a draft is the measured costs' call
            assert 0 <= cell["acceptance_rate"] <= 1
        if column.startswith("k="):
            assert 0 <= cell["acceptance_rate"] <= 1 and 0 <= cell["alpha_hat"] <= 1
            assert 1 <= cell["tokens_per_round"] <= cell["k"] + 1
            split = cell["round_ms"]
            assert split["draft"] > 0 and split["target"] > 0
            assert split["total"] == pytest.approx(split["draft"] + split["target"] + split["other"], abs=0.01)
            assert cell["bound"] > 0 and cell["of_bound"] == pytest.approx(cell["speedup"] / cell["bound"], abs=0.01)
    assert set(result["best_k"].values()) <= {2, 3}
    assert set(result["peak_memory_mib"]) == {"draft", "verify", "gateway", "bench (peer)"}
    assert all(v > 10 for v in result["peak_memory_mib"].values())
    assert 0 < result["costs"]["c"] and set(result["costs"]["v"]) == {"2", "3"}
    assert len(result["goals"]["per_cell"]) == len(TEMPERATURES) * len(LENGTHS)
    assert all(0 < c["auto_vs_best_k"] for c in result["goals"]["per_cell"])

    # The mismatched draft: target-only and AUTO at 48 tokens.
    mismatched = {(c["temperature"], c["column"]): c for c in result["mismatched_draft"]}
    assert set(mismatched) == {(t, col) for t in TEMPERATURES for col in (TARGET_ONLY, AUTO)}
    for t in TEMPERATURES:
        auto = mismatched[(t, AUTO)]
        assert auto["runs"] == 2 and auto["length"] == 48 and auto["tokens_per_s"] > 0
        # (Untrained toy models all echo their input, so here the "mismatched" draft agrees.)
        assert 0 < auto["speculative_tokens"] <= 1 and 0 <= auto["acceptance_rate"] <= 1
    assert "Mismatched draft" in table
    assert {"auto_short_at_least_0.97x_target_only", "auto_within_5%_of_best_k", "auto_mismatched_at_least_0.95x_target_only"} <= set(result["goals"])


def test_a_corrupted_verify_step_fails_the_greedy_check(toy, tmp_path):
    # Greedy cells only, no load section nor mismatched draft: the greedy check is all it asks.
    config = dataclasses.replace(
        tiny_config(toy, tmp_path / "out"), temperatures=(0.0,), in_flight=(), mismatched_repeats=0
    )
    result = run_bench(config, programs={"verify": [sys.executable, "tests/corrupt_verify.py"]})
    failures = result["greedy_failures"]
    assert failures, "the corrupted verifier went unnoticed"
    for failure in failures:
        assert failure["expected"] != failure["got"] and failure["top2_logit_gap"] > 1e-4
        assert 0 <= failure["position"] < failure["length"]
    assert "MISMATCHES" in (config.out / "bench.md").read_text()


def test_the_cpu_is_named_with_its_widest_vector_instructions(tmp_path, monkeypatch):
    """Costs on the same model differ between an AVX2-only and an AVX-512 CPU of one name,
    and between CPU families of one name, so reports name all three."""
    from specdec import host

    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(host, "CPUINFO", cpuinfo)
    cpuinfo.write_text("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n")
    assert host.cpu_model() == "AMD EPYC, AVX-512"
    cpuinfo.write_text("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2\n")
    assert host.cpu_model() == "AMD EPYC, AVX2"
    cpuinfo.write_text("flags\t\t: fpu avx2\n")
    assert host.cpu_model() == ""
    # Two generations a virtual machine names alike, told apart by family and model.
    for family in (25, 26):
        cpuinfo.write_text(f"processor\t: 0\ncpu family\t: {family}\nmodel\t\t: 2\nmodel name\t: AMD EPYC\nflags\t\t: avx512f avx512_bf16\n" * 2)
        assert host.cpu_model() == f"AMD EPYC (family {family}, model 2), AVX-512 BF16"


def test_quick_load_sweep_reports_every_policy_at_every_point_and_checks_every_output(toy, tmp_path):
    config = SweepConfig(
        target=str(toy.target), draft=str(toy.close), streams=(1, 2), rates=(1.0,), temperatures=(0.0,),
        seconds=0.3, repeats=1, prompts=2, max_new_tokens=16, mismatched_streams=(1,), out=tmp_path,
    )  # fmt: skip
    result = run_sweep(config, progress=lambda line: None)
    write(result, tmp_path)

    assert json.loads((tmp_path / "load.json").read_text()) == json.loads(json.dumps(result))
    assert (tmp_path / "load.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = {(p["loop"], p["level"], p["temperature"]): p for p in result["points"]}
    levels = (("closed", 1), ("closed", 2), ("open", 1.0))
    assert set(points) == {(loop, level, 0.0) for loop, level in levels}
    for point in points.values():
        assert set(point["policies"]) == set(POLICIES)
        for measured in point["policies"].values():
            assert measured["tokens_per_s"] > 0 and 0 <= measured["slo_met"] <= 1
            assert measured["itl_p99_ms"] > 0 and measured["request_itl_p99_ms"] > 0
            assert measured["differ_from_target_only"] == 0
        assert point["auto_over_best_fixed"] > 0 and point["auto_over_table"] > 0
        # AUTO's rounds by how it chose their k, shares summing to one; fixed schedules choose nothing
        shares = point["policies"]["auto"]["auto_choices"]
        assert shares and set(shares) <= set(CHOICE_NAMES.values()) and sum(shares.values()) == pytest.approx(1, abs=0.01)
        assert all(not r["auto_choices"] for r in result["runs"] if r["policy"] in ("k=4", "target-only"))
    # Every completed request was checked against its prompt's target-only output.
    assert sum(r["requests"] for r in result["runs"]) > len(result["runs"])
    # The mismatched draft: AUTO against target-only, every output checked too.
    mismatched = {(p["loop"], p["level"], p["temperature"]): p for p in result["mismatched_draft"]["points"]}
    assert set(mismatched) == {("closed", 1, 0.0)}
    for point in mismatched.values():
        assert set(point["policies"]) == {"auto", "target-only"} and point["auto_over_target_only"] > 0
        assert all(m["differ_from_target_only"] == 0 for m in point["policies"].values())
    table = (tmp_path / "load.md").read_text()
    assert "| T | streams | auto | table | k=2 | k=4 | k=8 | target-only | auto / best fixed | auto / table |" in table
    assert "| T | streams | auto | target-only | auto / target-only |" in table
    assert "## closed loop: AUTO's rounds by how it chose their k (shares)" in table
    assert "All completions equal target-only's." in table
