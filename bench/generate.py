"""Generation speed with and without the KV cache, against one forward of the whole sequence.

The debug model (random weights, fp32, CPU) continues an 8-token prompt by 256 tokens, greedy,
three ways taking turns each round: A with the KV cache (``model.decoding.generate``), B without
it (the whole sequence recomputed at each step), and C, one forward of the 264 tokens that
generation ends with. A/C is what the cache leaves of generation's cost over a single forward;
B/A what it saves. A and B must write the same tokens. The FLOPs of each (torch's
``FlopCounterMode``, matmuls and attention) are counted once, beside the times: a decode step
multiplies one token's activations by every weight, so its FLOPs are one token's share of a
forward, while its time is bounded by reading the weights.

    python bench/generate.py            # about a minute on 1 thread
    python bench/generate.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import benchlib
import torch
from torch.utils.flop_counter import FlopCounterMode

from plugtrain.model.decoding import generate
from plugtrain.model.llama.transformer import FLAVORS, Transformer

NAME = "generate"
PROMPT_TOKENS = 8


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--flavor", default="debug", choices=tuple(FLAVORS))
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_options)
    new_tokens, n_rounds = (32, 2) if args.quick else (args.new_tokens, args.rounds)
    model = Transformer(FLAVORS[args.flavor])
    model.init_weights(0)
    model.eval()
    prompt = torch.randint(
        0, model.args.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)
    )
    written: dict[str, torch.Tensor] = {}

    def cached() -> None:
        written["cached"] = generate(model, prompt, new_tokens)

    def uncached() -> None:
        written["uncached"] = generate(model, prompt, new_tokens, use_cache=False)

    whole = torch.cat([prompt, torch.zeros(1, new_tokens, dtype=torch.long)], dim=1)

    def one_forward() -> None:
        with torch.no_grad():
            model(whole)

    contestants = [("cached", cached), ("uncached", uncached), ("one_forward", one_forward)]
    flops = {}
    for name, run in contestants:
        with FlopCounterMode(display=False) as counter:
            run()
        flops[name] = counter.get_total_flops()
    cached()  # warm-up: first calls allocate
    one_forward()
    seconds: dict[str, list[float]] = {name: [] for name, _ in contestants}
    for index in benchlib.rounds(n_rounds, len(contestants)):
        name, run = contestants[index]
        start = time.perf_counter()
        run()
        seconds[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    results = {
        "flavor": args.flavor,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": new_tokens,
        "rounds": n_rounds,
        "same_tokens": torch.equal(written["cached"], written["uncached"]),
        "seconds": {name: benchlib.summary(s) for name, s in seconds.items()},
        "tokens_per_s": {
            "cached": new_tokens / medians["cached"],
            "uncached": new_tokens / medians["uncached"],
        },
        "flops": flops,
        "cached_over_one_forward": benchlib.paired_ratio(seconds["cached"], seconds["one_forward"]),
        "uncached_over_cached": benchlib.paired_ratio(seconds["uncached"], seconds["cached"]),
    }
    rows = [
        ("A: KV cache", "cached"),
        ("B: no cache", "uncached"),
        (f"C: one forward of {PROMPT_TOKENS + new_tokens} tokens", "one_forward"),
    ]
    print(
        benchlib.table(
            ["", "seconds (median)", "new tokens/s", "GFLOP"],
            [
                [label, medians[name], results["tokens_per_s"].get(name, ""), flops[name] / 1e9]
                for label, name in rows
            ],
        )
    )
    a_c, b_a = results["cached_over_one_forward"], results["uncached_over_cached"]
    print(
        f"\nFLOPs: A/C {flops['cached'] / flops['one_forward']:.2f}, B/A "
        f"{flops['uncached'] / flops['cached']:.1f}. Time: A/C {a_c['ratio']['median']:.2f} "
        f"(95% CI {a_c['ratio_ci95'][0]:.2f}-{a_c['ratio_ci95'][1]:.2f}), B/A "
        f"{b_a['ratio']['median']:.1f}. A and B write the same tokens: {results['same_tokens']}"
    )
    benchlib.write_json(args.out, NAME, args, results)


if __name__ == "__main__":
    main()
