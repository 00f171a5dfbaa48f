"""The benchmark's figures: cells (temperature x output length x column), the performance
model's bound (docs/design.md), the issue's goals, and the three outputs: bench.json,
bench.md (the table) and speedup.png.

Terms, per cell of our speculative columns:
  acceptance rate = accepted / proposed
  α̂              = accepted / (accepted + rejections)
  E              = (1 - α̂^(k+1)) / (1 - α̂), expected tokens per round
  bound          = E / (k·c + v(k)), with c and v(k) measured in this run
  round split    = client-side time per round (after the first) into the draft's own
                   compute, the target's forward plus acceptance, and everything else
                   (RPC, Python, bookkeeping, the gateway hop)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.runs import PEER_CONSTANT, PEER_DEFAULT, PEER_PLAIN
from specdec.speculation_gain import gain

TARGET_ONLY = "target-only"
AUTO = "auto"
GOALS = {
    "target_only_vs_generate": 0.9,  # our target-only tokens/s over plain generate, every cell
    "greedy_longest_best_k_speedup": 1.8,  # greedy, longest output, best k, over our target-only
    "other_share_max": 0.15,  # everything but the two models' forwards, share of a round
    "of_bound_min": 0.85,  # measured speedup over the theoretical one
    "auto_short_min": 0.97,  # AUTO over target-only at outputs of at most AUTO_SHORT tokens
    "auto_vs_best_k_min": 0.95,  # AUTO over the best fixed k, longer outputs
    "auto_mismatched_min": 0.95,  # AUTO over target-only with the mismatched draft
}
AUTO_SHORT = 32  # outputs this short must never run below target-only under AUTO


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _cell(records: list, costs, baseline_tps: float) -> dict[str, Any]:
    runs = [r.run for r in records]
    k = records[0].k
    tps = _median([r.tokens_per_s for r in runs])
    cell: dict[str, Any] = {
        "runs": len(runs),
        "tokens_per_s": round(tps, 2),
        "speedup": round(tps / baseline_tps, 3) if baseline_tps else 0.0,
    }
    if records[0].column in (TARGET_ONLY, AUTO) or records[0].column.startswith("k="):
        proposed = sum(r.proposed for r in runs)
        accepted = sum(r.accepted for r in runs)
        rejections = sum(r.rejections for r in runs)
        rounds = sum(r.rounds for r in runs)
        steady = sum(r.steady_rounds for r in runs)
        round_s = sum(r.steady_s for r in runs) / steady if steady else 0.0
        draft_s = sum(r.draft_path_s for r in runs) / steady if steady else 0.0
        compute_s = sum(r.draft_compute_s for r in runs) / steady if steady else 0.0
        wait_s = sum(r.draft_wait_s for r in runs) / steady if steady else 0.0
        target_s = sum(r.target_s for r in runs) / steady if steady else 0.0
        other_s = round_s - draft_s - target_s
        cell.update(
            k=k,
            acceptance_rate=round(accepted / proposed, 4) if proposed else 0.0,
            alpha_hat=round(accepted / (accepted + rejections), 4) if accepted + rejections else 0.0,
            tokens_per_round=round(sum(len(r.token_ids) for r in runs) / rounds, 3) if rounds else 0.0,
            accepted_per_round=round(accepted / rounds, 3) if rounds else 0.0,
            round_ms={"draft": round(draft_s * 1e3, 3), "target": round(target_s * 1e3, 3), "other": round(other_s * 1e3, 3), "total": round(round_s * 1e3, 3)},
            other_share=round(other_s / round_s, 3) if round_s else 0.0,
            draft_compute_ms=round(compute_s * 1e3, 3),  # the draft's own time per round, hidden or not
            draft_wait_ms=round(wait_s * 1e3, 3),  # what a round waited for its proposal
        )
        if records[0].column == AUTO:
            rounds_ = [(k, n) for r in runs for k, n in zip(r.draft_tokens, r.round_tokens)]
            speculative = [(k, n) for k, n in rounds_ if k]
            emitted = sum(n for _, n in rounds_)
            cell.update(
                mean_k=round(sum(k for k, _ in speculative) / len(speculative), 2) if speculative else 0.0,
                speculative_tokens=round(sum(n for _, n in speculative) / emitted, 3) if emitted else 0.0,
            )
        elif k:
            alpha = cell["alpha_hat"]
            bound = gain(alpha, k, costs.c, costs.v[k])
            cell.update(bound=round(bound, 3), of_bound=round(cell["speedup"] / bound, 3))
    return cell


def build(
    config, records: list, costs, best_k: dict[float, int], memory: dict[str, float], failures: list[dict], machine: dict,
    mismatched: list,
) -> dict:
    grouped: dict[tuple[float, int, str], list] = defaultdict(list)
    for record in records:
        grouped[(record.temperature, record.length, record.column)].append(record)
    cells = []
    for temperature in config.temperatures:
        for length in config.lengths:
            ours_base = _median([r.run.tokens_per_s for r in grouped[(temperature, length, TARGET_ONLY)]])
            peer_base = _median([r.run.tokens_per_s for r in grouped[(temperature, length, PEER_PLAIN)]])
            for column in config.columns:
                base = peer_base if column in (PEER_PLAIN, PEER_DEFAULT, PEER_CONSTANT) else ours_base
                group = grouped[(temperature, length, column)]
                cells.append({"temperature": temperature, "length": length, "column": column, **_cell(group, costs, base)})
    result = {
        "machine": machine,
        "config": {k: (str(v) if k == "out" else v) for k, v in asdict(config).items()},
        "threads": {"verify": config.verify_threads, "draft": config.draft_threads, "peer (transformers)": config.peer_threads},
        "costs": {
            "target_step_ms": round(costs.target_step_s * 1e3, 3),
            "draft_step_ms": round(costs.draft_step_s * 1e3, 3),
            "c": round(costs.c, 4),
            "v": {str(k): round(v, 3) for k, v in costs.v.items()},
        },
        "best_k": {str(t): k for t, k in best_k.items()},
        "cells": cells,
        "mismatched_draft": _mismatched_cells(config, mismatched, costs),
        "peak_memory_mib": memory,
        "greedy_failures": failures,
    }
    result["goals"] = goals(result, config)
    return result


def _mismatched_cells(config, records: list, costs) -> list[dict]:
    """Target-only and AUTO with the mismatched draft, per temperature."""
    cells = []
    for temperature in config.temperatures:
        group = {column: [r for r in records if r.temperature == temperature and r.column == column] for column in (TARGET_ONLY, AUTO)}
        base = _median([r.run.tokens_per_s for r in group[TARGET_ONLY]])
        for column, records_ in group.items():
            if records_:
                cells.append({"temperature": temperature, "length": config.mismatched_length, "column": column, **_cell(records_, costs, base)})
    return cells


def _find(cells: list[dict], temperature: float, length: int, column: str) -> dict:
    return next(c for c in cells if (c["temperature"], c["length"], c["column"]) == (temperature, length, column))


def best_ours(cells: list[dict], temperature: float, length: int) -> dict:
    ours = [c for c in cells if c["temperature"] == temperature and c["length"] == length and c["column"].startswith("k=")]
    return max(ours, key=lambda c: c["speedup"])


def goals(result: dict, config) -> dict:
    cells = result["cells"]
    per_cell = []
    for temperature in config.temperatures:
        for length in config.lengths:
            best = best_ours(cells, temperature, length)
            ours_tps = _find(cells, temperature, length, TARGET_ONLY)["tokens_per_s"]
            plain_tps = _find(cells, temperature, length, PEER_PLAIN)["tokens_per_s"]
            peer = max(_find(cells, temperature, length, c)["speedup"] for c in (PEER_DEFAULT, PEER_CONSTANT))
            per_cell.append({
                "temperature": temperature, "length": length, "best": best["column"],
                "target_only_vs_generate": round(ours_tps / plain_tps, 3) if plain_tps else 0.0,
                "speedup": best["speedup"], "peer_speedup": peer,
                "other_share": best["other_share"], "of_bound": best.get("of_bound", 0.0),
            })  # fmt: skip
    longest = max(config.lengths)
    greedy_longest = next((c for c in per_cell if c["temperature"] == 0.0 and c["length"] == longest), None)
    for c in per_cell:
        auto = _find(cells, c["temperature"], c["length"], AUTO)
        best_tps = _find(cells, c["temperature"], c["length"], c["best"])["tokens_per_s"]
        c["auto_speedup"] = auto["speedup"]
        c["auto_vs_best_k"] = round(auto["tokens_per_s"] / best_tps, 3) if best_tps else 0.0
    short = [c for c in per_cell if c["length"] <= AUTO_SHORT]
    longer = [c for c in per_cell if c["length"] > AUTO_SHORT]
    mismatched = [c for c in result["mismatched_draft"] if c["column"] == AUTO]
    return {
        "per_cell": per_cell,
        "target_only_at_least_0.9x_generate": all(c["target_only_vs_generate"] >= GOALS["target_only_vs_generate"] for c in per_cell),
        f"greedy_{longest}_best_k_at_least_1.8x": bool(greedy_longest and greedy_longest["speedup"] >= GOALS["greedy_longest_best_k_speedup"]),
        "ours_at_least_peer": all(c["speedup"] >= c["peer_speedup"] for c in per_cell),
        "other_at_most_15%_of_round": all(c["other_share"] <= GOALS["other_share_max"] for c in per_cell),
        "at_least_85%_of_bound": all(c["of_bound"] >= GOALS["of_bound_min"] for c in per_cell),
        "auto_short_at_least_0.97x_target_only": bool(short) and all(c["auto_speedup"] >= GOALS["auto_short_min"] for c in short),
        "auto_within_5%_of_best_k": bool(longer) and all(c["auto_vs_best_k"] >= GOALS["auto_vs_best_k_min"] for c in longer),
        "auto_mismatched_at_least_0.95x_target_only": bool(mismatched)
        and all(c["speedup"] >= GOALS["auto_mismatched_min"] for c in mismatched),
    }


def markdown(result: dict) -> str:
    cfg, costs, m = result["config"], result["costs"], result["machine"]
    columns = [c["column"] for c in result["cells"] if c["temperature"] == cfg["temperatures"][0] and c["length"] == cfg["lengths"][0]]
    lines = [
        f"Machine: {m['cpu']} ({m['cpus']} CPUs), {m['device']}, torch {m['torch']}; torch threads: {result['threads']}.",
        f"Costs measured in this run: target step {costs['target_step_ms']} ms, draft step {costs['draft_step_ms']} ms, "
        f"c = {costs['c']}, v(k) = {costs['v']}. Best k (calibration): {result['best_k']}.",
        "",
        "Tokens/s (median over prompts and repeats), and in brackets the speedup: ours over our target-only, "
        "the peer's over plain `generate`.",
        "",
        "| T | tokens | " + " | ".join(columns) + " |",
        "| ---: | ---: |" + " ---: |" * len(columns),
    ]
    for t in cfg["temperatures"]:
        for length in cfg["lengths"]:
            row = [_find(result["cells"], t, length, c) for c in columns]
            lines.append(f"| {t} | {length} | " + " | ".join(f"{c['tokens_per_s']:.1f} ({c['speedup']:.2f}x)" for c in row) + " |")
    lines += [
        "",
        "Best k per cell: acceptance, α̂, tokens per round, time per round (draft / target / other), "
        "and the measured speedup against the bound E/(k·c + v(k)). Draft: the draft's compute on the round's "
        "critical path (a round asks for the next one's proposal before its own tokens are sent, so part of "
        "the draft's compute can be hidden); other: everything else (RPC, Python, sending the tokens).",
        "",
        "| T | tokens | best | speedup | acceptance | α̂ | tokens/round | round ms (draft / target / other) | other | bound | of bound | target-only / generate |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for g in result["goals"]["per_cell"]:
        c = _find(result["cells"], g["temperature"], g["length"], g["best"])
        r = c["round_ms"]
        lines.append(
            f"| {g['temperature']} | {g['length']} | {g['best']} | {c['speedup']:.2f}x | {c['acceptance_rate']:.3f} | {c['alpha_hat']:.3f} | "
            f"{c['tokens_per_round']:.2f} | {r['draft']:.2f} / {r['target']:.2f} / {r['other']:.2f} | {c['other_share']:.0%} | "
            f"{c['bound']:.2f}x | {c['of_bound']:.0%} | {g['target_only_vs_generate']:.2f} |"
        )
    lines += [
        "",
        "AUTO per cell: its speedup over target-only, its tokens/s over the best fixed k's, the mean k of its "
        "speculative rounds and the share of the output those rounds emitted.",
        "",
        "| T | tokens | auto speedup | auto / best k | mean k | tokens from speculative rounds |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for g in result["goals"]["per_cell"]:
        c = _find(result["cells"], g["temperature"], g["length"], AUTO)
        lines.append(
            f"| {g['temperature']} | {g['length']} | {c['speedup']:.2f}x | {g['auto_vs_best_k']:.2f} ({g['best']}) | "
            f"{c['mean_k']:.1f} | {c['speculative_tokens']:.0%} |"
        )
    lines += [
        "",
        "Mismatched draft (the draft's architecture and tokenizer, untrained weights): target-only against AUTO.",
        "",
        "| T | tokens | target-only | auto | acceptance | tokens from speculative rounds |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in cfg["temperatures"]:
        pair = {c["column"]: c for c in result["mismatched_draft"] if c["temperature"] == t}
        if len(pair) == 2:
            base, auto = pair[TARGET_ONLY], pair[AUTO]
            lines.append(
                f"| {t} | {auto['length']} | {base['tokens_per_s']:.1f} | {auto['tokens_per_s']:.1f} ({auto['speedup']:.2f}x) | "
                f"{auto['acceptance_rate']:.3f} | {auto['speculative_tokens']:.0%} |"
            )
    if result.get("in_flight"):
        lines += [
            "",
            f"Streams in flight (greedy, each request {result['config'].get('load_tokens', 128)} tokens): "
            "aggregate tokens/s, time to first token and "
            "inter-token latency.",
            "",
            "| in flight | mode | tokens/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
            "| ---: | --- | ---: | ---: | ---: |",
        ]
        for row in result["in_flight"]:
            ttft, itl = row["ttft_ms"], row["itl_ms"]
            lines.append(
                f"| {row['in_flight']} | {row['mode']} | {row['tokens_per_s']:.1f} | {ttft['p50']:.0f} / {ttft['p99']:.0f} | "
                f"{itl['p50']:.1f} / {itl['p99']:.1f} |"
            )
    lines += ["", "Goals: " + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in result["goals"].items() if k != "per_cell")]
    lines += ["Peak memory (MiB): " + ", ".join(f"{k} {v}" for k, v in result["peak_memory_mib"].items())]
    failures = result["greedy_failures"]
    lines += [f"Greedy equality: {'all speculative completions equal target-only' if not failures else f'{len(failures)} MISMATCHES: {failures}'}"]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    fig, axes = plt.subplots(1, len(cfg["temperatures"]), figsize=(5 * len(cfg["temperatures"]), 4), squeeze=False)
    for ax, t in zip(axes[0], cfg["temperatures"]):
        per_cell = [g for g in result["goals"]["per_cell"] if g["temperature"] == t]
        lengths = [g["length"] for g in per_cell]
        ax.plot(lengths, [g["speedup"] for g in per_cell], "o-", label="specdec (best k) over its target-only")
        ax.plot(lengths, [g["auto_speedup"] for g in per_cell], "^-", label="specdec auto over its target-only")
        ax.plot(lengths, [g["peer_speedup"] for g in per_cell], "s--", label="transformers assisted over generate")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.set_xlabel("output tokens")
        ax.set_ylabel("speedup")
        ax.set_title(f"temperature {t}")
        ax.legend(fontsize=8)
    fig.suptitle(f"{result['machine']['cpu']} ({result['machine']['device']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "bench.md").write_text(markdown(result))
    plot(result, out / "speedup.png")
