"""FSDP against HSDP: bytes each node sends over the inter-node network per optimizer step.

Computed from the model's shapes (``ModelArgs``) and a run config, no GPU and no timing: what
hybrid sharding saves on a multi-node job. Model: ring collectives (each rank sends ``(n - 1) /
n`` of an all-gather's or reduce-scatter's output over its ring link, twice that for an
all-reduce); a ring over several nodes crosses each node boundary, so that much leaves each
node. FSDP over all ``W = nodes x gpus_per_node`` ranks, per microbatch: the parameters are
all-gathered in forward (param dtype), again in backward for every block but the last (the
root and the last block stay gathered), and the gradients reduce-scattered (reduce dtype).
HSDP with ``dp_shard = gpus_per_node``: all of that stays inside a node; once per optimizer
step each rank all-reduces its ``1 / gpus_per_node`` gradient shard with its ``nodes - 1``
replicas.

    python bench/hsdp_volume.py                                      # configs/llama3_8b.toml, 2x8
    python bench/hsdp_volume.py --config configs/llama3_8b.toml --nodes 4 --gpus-per-node 8
"""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import benchlib

from plugtrain.model.llama.args import FLAVORS, ModelArgs
from plugtrain.model.sharding import DTYPES

NAME = "hsdp_volume"


def volumes(
    args: ModelArgs,
    *,
    nodes: int,
    gpus_per_node: int,
    microbatches: int,
    param_bytes: int,
    reduce_bytes: int,
) -> dict[str, float]:
    """Bytes each node sends to other nodes per optimizer step, by layout (see the module)."""
    world = nodes * gpus_per_node
    params = args.num_params()
    root = 2 * args.vocab_size * args.dim + args.dim  # embeddings, output, final norm
    block = (params - root) // args.n_layers
    ring = (world - 1) / world
    per_microbatch = ring * (
        params * param_bytes  # forward all-gathers
        + (params - root - block) * param_bytes  # backward all-gathers
        + params * reduce_bytes  # reduce-scatters
    )
    all_reduce = 2 * (nodes - 1) / nodes * params * reduce_bytes  # all of a node's shards
    return {
        "params": params,
        "fsdp": microbatches * per_microbatch,
        "hsdp": all_reduce,
        "hsdp_all_reduce_per_microbatch": microbatches * all_reduce,
    }


def main() -> None:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--config", type=Path, default=benchlib.REPO / "configs/llama3_8b.toml")
        parser.add_argument("--nodes", type=int, default=2)
        parser.add_argument("--gpus-per-node", type=int, default=8)

    cli = benchlib.parse_args(NAME, __doc__.splitlines()[0], add)
    config = tomllib.loads(cli.config.read_text())
    train, world = config["training"], cli.nodes * cli.gpus_per_node
    # The config's microbatch (batch_size / (its GPUs x grad_accum_steps)) kept on more GPUs.
    microbatch = train["batch_size"] // (8 * train["grad_accum_steps"])
    microbatches = train["batch_size"] // (world * microbatch)
    result = volumes(
        FLAVORS[config["model"]["flavor"]],
        nodes=cli.nodes,
        gpus_per_node=cli.gpus_per_node,
        microbatches=microbatches,
        param_bytes=DTYPES[train["mixed_precision_param"]].itemsize,
        reduce_bytes=DTYPES[train["mixed_precision_reduce"]].itemsize,
    )
    gb = 1e9
    print(
        f"{config['model']['flavor']}: {result['params'] / 1e9:.2f}B parameters, {cli.nodes} "
        f"nodes x {cli.gpus_per_node} GPUs, {microbatches} microbatches per step, "
        f"{train['mixed_precision_param']} params / {train['mixed_precision_reduce']} reduce\n"
    )
    print(
        benchlib.table(
            ["layout", "GB per node per optimizer step", "vs HSDP"],
            [
                ["FSDP over all GPUs", result["fsdp"] / gb, result["fsdp"] / result["hsdp"]],
                ["HSDP, all-reduce once per step", result["hsdp"] / gb, 1.0],
                [
                    "HSDP, all-reduce per microbatch",
                    result["hsdp_all_reduce_per_microbatch"] / gb,
                    result["hsdp_all_reduce_per_microbatch"] / result["hsdp"],
                ],
            ],
        )
    )
    benchlib.write_json(cli.out, NAME, cli, {"microbatches": microbatches, **result})


if __name__ == "__main__":
    main()
