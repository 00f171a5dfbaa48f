"""What coupling costs: seeded requests (coupled by the seed's Gumbel noise, repeatable in
every mode) against unseeded ones (rejection sampling) on one pair, in one process with
the services' own session classes (specdec.offline), so no network stack is timed.

For each held-out prompt and seed it decodes the same request both ways and reports the
acceptance rate, α̂, tokens per round and tokens per second of each, and the time of the
Gumbel noise itself (one draft position, and the k+1 positions of one verification).

    python -m bench.coupling [--temperature 0.8] [--k 4] [--max-new-tokens 128] [--seeds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specdec import defaults
from specdec.host import cpu_model
from specdec.offline import speculate
from specdec.runtime import CausalLM, ModelSpec
from specdec.sampling import SamplingParams, gumbel_noise


@dataclass
class Tally:
    tokens: int = 0
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0
    seconds: float = 0.0

    def figures(self) -> dict[str, float]:
        return {
            "acceptance_rate": self.accepted / self.proposed,
            "alpha_hat": self.accepted / (self.accepted + self.rejections),
            "tokens_per_round": self.tokens / self.rounds,
            "tokens_per_s": self.tokens / self.seconds,
            **asdict(self),
        }


def shown(path: str) -> str:
    """A model's path as the report shows it: relative to the repository when inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(defaults.REPO)) if resolved.is_relative_to(defaults.REPO) else path


def noise_seconds(rows: int, vocab_size: int, repeats: int = 200) -> float:
    """Median seconds of one call of gumbel_noise for `rows` positions."""
    times = []
    for position in range(repeats):
        start = time.perf_counter()
        gumbel_noise(7, position, rows, vocab_size)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.coupling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=defaults.DEFAULT_TARGET)
    parser.add_argument("--draft", default=defaults.DEFAULT_DRAFT)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--k", type=int, default=defaults.NUM_DRAFT_TOKENS)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per held-out prompt")
    parser.add_argument("--out", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = CausalLM.load(ModelSpec(args.target))
    draft = CausalLM.load(ModelSpec(args.draft))
    params = SamplingParams(temperature=args.temperature)
    tallies = {"coupled": Tally(), "rejection": Tally()}
    for prompt in defaults.heldout_prompts():
        ids = tokenizer.encode(prompt)
        for seed in range(args.seeds):
            for method, tally in tallies.items():  # interleaved, so that drift in the host's speed hits both
                start = time.perf_counter()
                result = speculate(
                    target, draft, ids, args.max_new_tokens, args.k, params, seed=seed, coupled=method == "coupled"
                )
                tally.seconds += time.perf_counter() - start
                tally.tokens += len(result.tokens)
                tally.rounds += result.rounds
                tally.proposed += result.proposed
                tally.accepted += result.accepted
                tally.rejections += result.rejections
    report = {
        "cpu": cpu_model(),
        "target": shown(args.target),
        "draft": shown(args.draft),
        "temperature": args.temperature,
        "k": args.k,
        "max_new_tokens": args.max_new_tokens,
        "requests_each": len(defaults.heldout_prompts()) * args.seeds,
        "methods": {method: tally.figures() for method, tally in tallies.items()},
        "noise_us": {
            "draft_position": noise_seconds(1, target.vocab_size) * 1e6,
            "verification": noise_seconds(args.k + 1, target.vocab_size) * 1e6,
        },
    }
    json.dump(report, sys.stdout, indent=1)
    print()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
