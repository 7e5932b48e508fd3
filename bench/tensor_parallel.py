"""Tensor parallelism: bytes per step of the 70B config by layout, and TP 2 vs FSDP 2 on CPU.

Part 1, from the shapes (no GPU, no timing): for ``configs/llama3_70b.toml``'s global batch on
``nodes x gpus_per_node`` GPUs, the bytes that leave each node and the bytes each GPU sends
inside its node per optimizer step, for FSDP over every GPU, HSDP (sharded within a node,
replicated across) and TP over a node's GPUs x FSDP across the nodes, with each layout's
memory estimate. Ring collectives, as ``bench/hsdp_volume.py`` counts them: a rank sends
``(n - 1) / n`` of an all-gather's or reduce-scatter's output, twice that of an all-reduce's; a
ring over several nodes crosses each node boundary. FSDP per microbatch: parameters
all-gathered in forward and again in backward (but the root and the last block) in the param
dtype, gradients reduce-scattered in the reduce dtype. TP with sequence parallelism per
microbatch: in every block 2 all-gathers and 2 reduce-scatters of the ``[tokens, dim]``
activations in forward, as many in backward, and as many again when full activation
checkpointing recomputes the forward; the embedding's and final norm's 4 more; the loss's
all-reduces of ``[tokens]`` are left out (under 0.01%).

Part 2, measured: tokens per CPU-second (all processes' CPU time over the timed steps) of 2
gloo processes training the debug model in fp32 under FSDP 2 and under TP 2, the same global
batch. TP is not expected to pay on CPU processes: it adds collectives per block.

Part 3, counted: the collectives of one non-logging step by op, on each of 2 gloo processes
training the tiny model in fp32 under FSDP 2 and under TP 2, with the cost counter
(``plugtrain.testing.count_costs``: a 3-step run's counts less a 2-step run's).
``tests/test_tensor_parallel_plugins.py`` asserts the same numbers and says where each comes
from.

    python bench/tensor_parallel.py            # parts 1 to 3 (a few minutes on 2 cores)
    python bench/tensor_parallel.py --quick    # part 2 with fewer steps
    python bench/tensor_parallel.py --collectives-only   # part 3 only (about a minute)
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import tomllib

import benchlib

from plugtrain.model import Checkpointing, estimate_memory
from plugtrain.model.llama.args import FLAVORS, ModelArgs
from plugtrain.model.sharding import DTYPES
from plugtrain.plugin import hookimpl

NAME = "tensor_parallel"
CONFIG = benchlib.REPO / "configs/llama3_70b.toml"
LAYOUTS = {"FSDP 2": (), "TP 2": ("--parallelism.tp", "2")}
"""The 2-process layouts of parts 2 and 3, by name: their command-line arguments."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """A way to place the model on the GPUs, and the microbatch it runs."""

    name: str
    tp: int
    dp_replicate: int
    microbatch: int
    checkpointing: Checkpointing


def volumes(
    args: ModelArgs,
    layout: Layout,
    *,
    nodes: int,
    gpus: int,
    batch: int,
    seq_len: int,
    p: int,
    r: int,
) -> dict[str, float]:
    """Bytes leaving each node and sent by each GPU inside its node, per optimizer step."""
    world = nodes * gpus
    params = args.num_params()
    root = 2 * args.vocab_size * args.dim + args.dim
    block = (params - root) // args.n_layers
    data_ranks = world // layout.tp
    microbatches = batch // (data_ranks * layout.microbatch)
    fsdp_bytes = (params * p + (params - root - block) * p + params * r) / layout.tp
    if layout.tp > 1:  # FSDP over the nodes (one rank each) on each TP shard; TP inside
        ring = (nodes - 1) / nodes
        leaving = microbatches * ring * fsdp_bytes * gpus  # the node's gpus rings all cross
        recompute = 4 if layout.checkpointing.mode == "full" else 0
        per_layer = 8 + recompute
        activation = layout.microbatch * seq_len * args.dim * p
        inside = microbatches * (gpus - 1) / gpus * activation * (per_layer * args.n_layers + 4)
    elif layout.dp_replicate > 1:  # shards inside a node, all-reduce across once per step
        inside = microbatches * (gpus - 1) / gpus * fsdp_bytes
        leaving = 2 * (nodes - 1) / nodes * params * r
    else:  # one ring over every GPU
        inside = leaving = microbatches * (world - 1) / world * fsdp_bytes
    return {"microbatches": microbatches, "leaving_node": leaving, "inside_node": inside}


def shape_volumes(cli: argparse.Namespace) -> list[dict]:
    config = tomllib.loads(CONFIG.read_text())
    train = config["training"]
    args = FLAVORS[config["model"]["flavor"]]
    p = DTYPES[train["mixed_precision_param"]].itemsize
    r = DTYPES[train["mixed_precision_reduce"]].itemsize
    world, tp = cli.nodes * cli.gpus_per_node, config["parallelism"]["tp"]
    shipped = Checkpointing(config["activation_checkpointing"]["mode"])
    microbatch = train["batch_size"] // (world // tp * train["grad_accum_steps"])
    layouts = [
        Layout(f"FSDP over {world}", 1, 1, 1, Checkpointing("full")),
        Layout(f"HSDP {cli.nodes} x {cli.gpus_per_node}", 1, cli.nodes, 1, Checkpointing("full")),
        Layout(f"TP {tp} x FSDP {world // tp} (shipped)", tp, 1, microbatch, shipped),
    ]
    rows = []
    for layout in layouts:
        moved = volumes(
            args, layout, nodes=cli.nodes, gpus=cli.gpus_per_node, batch=train["batch_size"],
            seq_len=train["seq_len"], p=p, r=r,
        )  # fmt: skip
        memory = estimate_memory(
            args,
            world_size=world,
            microbatch=layout.microbatch,
            seq_len=train["seq_len"],
            param_dtype=train["mixed_precision_param"],
            reduce_dtype=train["mixed_precision_reduce"],
            checkpointing=layout.checkpointing,
            dp_replicate=layout.dp_replicate,
            tp=layout.tp,
        )
        rows.append({"layout": layout.name, **moved, "memory_gib": memory.total / 2**30})
    fsdp = rows[0]["leaving_node"]
    print(
        f"70B ({args.num_params() / 1e9:.1f}B parameters), {cli.nodes} nodes x "
        f"{cli.gpus_per_node} GPUs, {train['batch_size']} x {train['seq_len']} tokens per step\n"
    )
    print(
        benchlib.table(
            [
                "layout",
                "microbatches",
                "GB leaving each node",
                "vs FSDP",
                "GB inside, per GPU",
                "GiB per GPU (estimate)",
            ],
            [
                [
                    row["layout"],
                    row["microbatches"],
                    row["leaving_node"] / 1e9,
                    row["leaving_node"] / fsdp,
                    row["inside_node"] / 1e9,
                    row["memory_gib"],
                ]
                for row in rows
            ],
        )
    )
    return rows


class CpuClock:
    """Records this process's CPU time after every step (``post_step``)."""

    def __init__(self) -> None:
        self.after_step: list[float] = []

    @hookimpl
    def post_step(self) -> None:
        self.after_step.append(time.process_time())


def measure(layout: tuple[str, ...], steps: int, folder: str) -> float:
    """On each rank: the CPU-seconds of steps 3 .. ``steps`` (the first two warm up)."""
    from plugtrain.testing import make_trainer

    clock = CpuClock()
    args = benchlib.trainer_args("debug", "float32", *layout)
    trainer = make_trainer(folder, *args[2:], steps=steps, plugins=[("clock", clock)])
    trainer.run()
    return clock.after_step[-1] - clock.after_step[1]


def cpu_throughput(cli: argparse.Namespace) -> list[dict]:
    from plugtrain.testing import run_distributed

    steps = 5 if cli.quick else 12
    tokens = 8 * 128 * (steps - 2)  # trainer_args' batch of 8 x 128 tokens per step
    rows = []
    for name, layout in LAYOUTS.items():
        folder = str(benchlib.REPO / "outputs" / "bench" / f"tp_{name.replace(' ', '')}")
        cpu = sum(run_distributed(measure, 2, layout, steps, folder))
        rows.append({"layout": name, "cpu_s": cpu, "tokens_per_cpu_s": tokens / cpu})
    fsdp = rows[0]["tokens_per_cpu_s"]
    print(f"\ndebug model, fp32, 2 gloo processes, {steps - 2} timed steps of 8 x 128 tokens\n")
    print(
        benchlib.table(
            ["layout", "CPU-s (both processes)", "tokens per CPU-s", "vs FSDP 2"],
            [
                [r["layout"], r["cpu_s"], r["tokens_per_cpu_s"], r["tokens_per_cpu_s"] / fsdp]
                for r in rows
            ],
        )
    )
    return rows


def count_layouts(folder: str) -> dict[str, dict[str, float]]:
    """On each rank: the collectives per non-logging step of each of ``LAYOUTS``, by op."""
    from plugtrain.testing import count_costs

    fp32 = ("--training.mixed_precision_param", "float32")
    return {
        name: count_costs(f"{folder}/{i}", *fp32, *layout, short=2, long=3).collectives
        for i, (name, layout) in enumerate(LAYOUTS.items())
    }


def collectives_per_step() -> dict[str, dict[str, float]]:
    from plugtrain.testing import run_distributed

    folder = str(benchlib.REPO / "outputs" / "bench" / "tp_collectives")
    counts = run_distributed(count_layouts, 2, folder)
    assert counts[0] == counts[1], counts  # every rank makes the same collectives
    by_layout = counts[0]
    ops = sorted({op for ops in by_layout.values() for op in ops})
    print("\ntiny model (2 blocks), fp32, 2 gloo processes: collectives per non-logging step\n")
    print(
        benchlib.table(
            ["op", *by_layout],
            [[op, *(ops.get(op, 0) for ops in by_layout.values())] for op in ops]
            + [["all", *(sum(ops.values()) for ops in by_layout.values())]],
        )
    )
    return by_layout


def main() -> None:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--nodes", type=int, default=8)
        parser.add_argument("--gpus-per-node", type=int, default=8)
        parser.add_argument("--shapes-only", action="store_true", help="part 1 only")
        parser.add_argument("--collectives-only", action="store_true", help="part 3 only")

    cli = benchlib.parse_args(NAME, __doc__.splitlines()[0], add)
    results = {}
    if not cli.collectives_only:
        results["shapes"] = shape_volumes(cli)
    if not (cli.shapes_only or cli.collectives_only):
        results["cpu"] = cpu_throughput(cli)
    if not cli.shapes_only:
        results["collectives"] = collectives_per_step()
    benchlib.write_json(cli.out, NAME, cli, results)


if __name__ == "__main__":
    main()
