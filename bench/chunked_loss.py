"""The loss path's peak memory and time, whole logits vs in chunks (``[model] loss_chunks``).

At Llama 3's 128k vocabulary and a batch of 2 x 2048 tokens (fp32, CPU), the output projection
and the cross-entropy, forward and backward, from the final norm's output to its gradient and
the output matrix's: once with the whole logits (``cross_entropy`` of ``Transformer.project``),
once with ``ChunkedLoss``. Peak memory is each variant's own process's peak resident set above
what it held before the loss (inputs, weights, their gradients' buffers allocated beforehand;
Linux: ``/proc/self/status``, its peak reset first);
the time ratio is measured in one process, the variants taking turns.

    python bench/chunked_loss.py          # a few minutes on 2 cores, about 7 GB of memory
    python bench/chunked_loss.py --quick  # a 32k vocabulary, batch 1 x 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import benchlib
import torch
import torch.nn.functional as F

from plugtrain.model import ChunkedLoss, cross_entropy

NAME = "chunked_loss"
DIM = 128  # the loss path's memory does not depend on it; its time does


def shapes(quick: bool) -> tuple[int, int, int]:
    """(vocab, batch, seq_len) of the measurement."""
    return (32_000, 1, 1024) if quick else (128_256, 2, 2048)


def make_inputs(
    vocab: int, batch: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(batch, seq_len, DIM, generator=generator, requires_grad=True)
    weight = (torch.randn(vocab, DIM, generator=generator) * DIM**-0.5).requires_grad_()
    targets = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    # The gradients' buffers exist before the measured pass, as a training step's do.
    hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
    return hidden, weight, targets


def loss_pass(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunks: int
) -> float:
    """Forward and backward of the loss path; returns the loss."""

    def project(h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, weight)

    if chunks == 1:
        loss = cross_entropy(project(hidden), targets)
    else:
        loss, _ = ChunkedLoss(targets, chunks)(hidden, project)
    loss.backward()
    return loss.item()


def peak_child(vocab: int, batch: int, seq_len: int, chunks: int) -> None:
    """In a fresh process: print the peak resident bytes the loss pass adds, and its loss."""
    loss_pass(*make_inputs(vocab, 1, 16), chunks)  # torch's one-time set-up, not the loss's
    inputs = make_inputs(vocab, batch, seq_len)
    before = _status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    loss = loss_pass(*inputs, chunks)
    print(json.dumps({"peak_bytes": _status_bytes("VmHWM") - before, "loss": loss}))


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (Linux), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak(vocab: int, batch: int, seq_len: int, chunks: int, threads: int) -> dict:
    argv = [sys.executable, __file__, "--child", f"{vocab},{batch},{seq_len},{chunks}"]
    argv += ["--threads", str(threads)]
    # A fixed mmap threshold: glibc then gives every large tensor back when it is freed, so
    # that the peak resident set is the peak of live tensors, not of the heap's high water.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.splitlines()[-1])


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[4, 16], help="chunk counts to compare"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)


def main() -> None:
    args = benchlib.parse_args(NAME, __doc__.splitlines()[0], add_args)
    if args.child:
        peak_child(*map(int, args.child.split(",")))
        return
    vocab, batch, seq_len = shapes(args.quick)
    variants = [1, *args.chunks]
    peaks = {c: peak(vocab, batch, seq_len, c, args.threads) for c in variants}
    inputs = make_inputs(vocab, batch, seq_len)
    seconds: list[list[float]] = [[] for _ in variants]
    for i in benchlib.rounds(2 if args.quick else 4, len(variants)):
        start = time.perf_counter()
        loss_pass(*inputs, variants[i])
        seconds[i].append(time.perf_counter() - start)
    whole = peaks[1]
    results = {
        "vocab": vocab,
        "batch": batch,
        "seq_len": seq_len,
        "dim": DIM,
        "whole_logits_bytes_fp32": batch * seq_len * vocab * 4,
        "variants": [
            {
                "loss_chunks": c,
                "peak_bytes": peaks[c]["peak_bytes"],
                "peak_vs_whole": peaks[c]["peak_bytes"] / whole["peak_bytes"],
                "loss": peaks[c]["loss"],
                "loss_rel_diff": abs(peaks[c]["loss"] - whole["loss"]) / whole["loss"],
                "time_vs_whole": benchlib.paired_ratio(seconds[i], seconds[0]),
            }
            for i, c in enumerate(variants)
        ],
    }
    print(
        benchlib.table(
            ["loss_chunks", "peak MiB", "peak / whole", "time / whole [95% CI]", "loss rel. diff"],
            [
                [
                    v["loss_chunks"],
                    v["peak_bytes"] / 2**20,
                    v["peak_vs_whole"],
                    f"{v['time_vs_whole']['ratio']['median']:.3f} "
                    f"[{v['time_vs_whole']['ratio_ci95'][0]:.3f}, "
                    f"{v['time_vs_whole']['ratio_ci95'][1]:.3f}]",
                    f"{v['loss_rel_diff']:.1e}",
                ]
                for v in results["variants"]
            ],
        )
    )
    benchlib.write_json(args.out, NAME, args, results)


if __name__ == "__main__":
    main()
