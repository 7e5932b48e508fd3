"""Tests of data mixtures (plugtrain.data.mixture, [data] sources): exact, deterministic
shares; every source read whole each epoch; the loader's guarantees; logged shares."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from plugtrain.data.mixture import BLOCK, MixtureDataset
from plugtrain.data.pipeline import PackedDataset, StatefulBatchLoader
from plugtrain.errors import ConfigError, DataError
from plugtrain.testing import SAMPLE, InMemoryStream, make_trainer, read_metrics
from plugtrain.training.launch import configure

SEQ_LEN = 3
SIZES = (5, 40, 300)


def _datasets() -> list[PackedDataset]:
    """Source s's sample i starts with token s * 100_000 + i * (SEQ_LEN + 1)."""
    return [
        PackedDataset(InMemoryStream(s * 100_000 + torch.arange(n * (SEQ_LEN + 1))), SEQ_LEN)
        for s, n in enumerate(SIZES)
    ]


def _mixture(weights=(1, 2, 5), **kw) -> MixtureDataset:
    return MixtureDataset(_datasets(), weights, ["a", "b", "c"], seed=kw.pop("seed", 0), **kw)


def _sources_and_samples(mix: MixtureDataset, indices: range) -> list[tuple[int, int]]:
    """Where the samples at ``indices`` came from, read off their first tokens."""
    first = mix.collate(indices)[0][:, 0].tolist()
    return [(t // 100_000, (t % 100_000) // (SEQ_LEN + 1)) for t in first]


def test_each_block_holds_the_exact_shares_and_each_epoch_every_sample() -> None:
    mix = _mixture()
    located = list(zip(*(a.tolist() for a in mix.locate(range(len(mix)))), strict=True))
    assert located == _sources_and_samples(mix, range(len(mix)))  # collate agrees
    sources = np.array([s for s, _ in located])
    for block in range(len(mix) // BLOCK):
        counts = np.bincount(sources[block * BLOCK : (block + 1) * BLOCK], minlength=3)
        assert np.abs(counts - BLOCK * np.array([1, 2, 5]) / 8).max() <= 1
    for s, n in enumerate(SIZES):  # each source whole in one mixture epoch; repeats permuted
        samples = [j for t, j in located if t == s]
        assert set(samples) == set(range(n))
        passes = [samples[k : k + n] for k in range(0, len(samples) - n + 1, n)]
        assert all(sorted(p) == list(range(n)) for p in passes)
        assert len(passes) < 2 or passes[0] != passes[1]
    assert mix.shares() == pytest.approx(
        {f"data_share.{n}": c / len(mix) for n, c in zip("abc", np.bincount(sources), strict=True)}
    )


def test_mixture_is_deterministic_by_seed() -> None:
    indices = np.arange(0, 3000, 7)  # into the third epoch
    sources, samples = _mixture().locate(indices)
    again = _mixture().locate(indices)
    assert np.array_equal(sources, again[0]) and np.array_equal(samples, again[1])
    assert not np.array_equal(samples, _mixture(seed=1).locate(indices)[1])
    # Vectorised over any index set: one at a time gives the same.
    assert [tuple(int(a[0]) for a in _mixture().locate([i])) for i in indices[:50]] == list(
        zip(sources[:50].tolist(), samples[:50].tolist(), strict=True)
    )
    sources, samples = _mixture(shuffle=False).locate(range(BLOCK))
    assert samples[sources == 1][:40].tolist() == list(range(40))


def test_loader_over_a_mixture_keeps_world_size_independence_and_resume() -> None:
    mix = _mixture()

    def loaders(world_size: int) -> list[StatefulBatchLoader]:
        kw = {"global_batch_size": 8, "grad_accum_steps": 2, "world_size": world_size, "seed": 3}
        return [StatefulBatchLoader(mix, rank=r, **kw) for r in range(world_size)]

    one, two = loaders(1), loaders(2)
    for step in range(6):
        if step == 3:
            two = loaders(2)
            for loader in two:
                loader.load_state_dict(one[0].state_dict())
        expected = torch.cat([mb[0] for mb in one[0].next_batch()])
        assert torch.equal(torch.cat([mb[0] for lo in two for mb in lo.next_batch()]), expected)


def test_a_weight_too_small_for_the_schedule_is_refused() -> None:
    with pytest.raises(DataError, match=r"data.sources 'a' has weight 1, too small a share"):
        _mixture(weights=(1, 10_000, 10_000))


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ('[{path="a", weight=0}]', "item 0 .* has weight 0: must be > 0"),
        ('[{path="a", wieght=2}]', r"item 0 .* must be \{path="),
        ('[{path="x/a"}, {path="a"}]', r"names \['a', 'a'\] repeat: give each source a distinct"),
    ],
)
def test_bad_sources_name_the_key(sources: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^config key 'data.sources' {message}"):
        configure(["--data.sources", sources])


def test_training_on_a_mixture_logs_each_sources_share(tmp_path) -> None:
    jsonl = str(SAMPLE / "validation.jsonl")
    sources = f'[{{path="{jsonl}", weight=3, name="big"}}, {{path="{jsonl}", name="small"}}]'
    trainer = make_trainer(tmp_path, "--data.sources", sources, "--training.batch_size", "8")
    trainer.run()
    shares = [
        (m["data_share.big"], m["data_share.small"]) for m in read_metrics(tmp_path) if "loss" in m
    ]
    assert len(shares) == 3 and all(big + small == pytest.approx(1) for big, small in shares)
    assert 0.5 < shares[-1][0] < 0.95  # rank 0's 8 samples a step: around 3/4
