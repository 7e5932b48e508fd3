"""grad_clip on 2 FSDP2 processes against torch.nn.utils.clip_grad_norm_ on 1 plain process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from plugtrain.plugin import full_tensor
from plugtrain.testing import make_trainer, read_metrics, run_distributed

STEPS = 4
# Measured: the 2-process parameters are within 4e-7 of the reference after 4 steps on an AVX2
# CPU, 1.1e-6 on an AVX512 one (its kernels round otherwise, by thread count too); clipping
# moves each parameter tensor by 1.4e-4 or more.
RTOL, ATOL = 1e-5, 5e-6
BATCH = ("--training.batch_size", "8")


def train_and_gather(dump_folder: str, args: list[str], steps: int) -> dict[str, torch.Tensor]:
    """Train a tiny run on this rank; return its full parameters, by name."""
    trainer = make_trainer(dump_folder, *args, steps=steps)
    trainer.run()
    return {n: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}


def every_case(root: str, cases: dict[str, list[str]]) -> dict[str, dict[str, torch.Tensor]]:
    """Run on each rank: ``train_and_gather`` for each case, in ``root/<case id>``."""
    return {case: train_and_gather(f"{root}/{case}", args, STEPS) for case, args in cases.items()}


def reference_run(
    dump_folder: Path, max_norm: float | None, norm_type: float
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same run as the trainer's, written out on its model, optimizer, schedule and data:
    one process, no FSDP, one microbatch, no plugin.

    Clips with ``torch.nn.utils.clip_grad_norm_`` unless ``max_norm`` is None; returns the
    pre-clip total norm of each step and the final parameters.
    """
    trainer = make_trainer(dump_folder, *BATCH, steps=STEPS)
    model, optimizer = trainer.model, trainer.optimizer
    norms = []
    for _ in range(STEPS):
        ((inputs, targets, *_),) = trainer.batches.next_batch()
        trainer.loss.fn(model(inputs), targets).backward()
        if max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
            norms.append(norm.item())
        optimizer.step()
        trainer.lr_scheduler.step(torch.tensor(True))
        optimizer.zero_grad(set_to_none=True)
    return norms, {n: p.detach() for n, p in model.named_parameters()}


CASES = {"l2": (2.0, 0.1, 1), "inf-accum2": (math.inf, 0.02, 2)}
"""Each case's ``(norm_type, max_norm, grad_accum_steps)``."""


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory: pytest.TempPathFactory, clip_args) -> tuple[Path, list[dict]]:
    """Every case on 2 FSDP2 ranks, in one session (a launch costs more than a case); the
    root folder and each rank's parameters, by case."""
    root = tmp_path_factory.mktemp("grad_clip")
    cases = {
        case: [
            *BATCH, "--training.grad_accum_steps", str(accum),
            *clip_args(max_norm, "--grad_clip.norm_type", str(norm_type)),
        ]
        for case, (norm_type, max_norm, accum) in CASES.items()
    }  # fmt: skip
    return root, run_distributed(every_case, 2, str(root), cases)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_fsdp2_processes_match_clip_grad_norm(tmp_path, fsdp2_runs, case):
    norm_type, max_norm, _ = CASES[case]
    root, by_rank = fsdp2_runs
    ranks = [by_case[case] for by_case in by_rank]
    ref_norms, ref_params = reference_run(tmp_path / "ref", max_norm, norm_type)
    _, unclipped = reference_run(tmp_path / "unclipped", None, norm_type)

    records = read_metrics(root / case)
    assert [r["grad_clip/grad_norm"] for r in records] == pytest.approx(ref_norms, rel=1e-5)
    assert min(ref_norms) > max_norm  # every step clips...
    assert [r["grad_clip/clipped"] for r in records] == [1.0] * STEPS
    for name, ref in ref_params.items():
        # ...and moves every parameter at least 10x further than the tolerance below.
        assert (ref - unclipped[name]).abs().max() > 10 * ATOL, name
        for rank, params in enumerate(ranks):
            torch.testing.assert_close(
                params[name], ref, rtol=RTOL, atol=ATOL, msg=f"{name} on rank {rank}"
            )
