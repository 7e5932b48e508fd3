"""Downstream evaluation: scores against a hand-written reference on 1 and 2 processes, task
files and their errors (through a run and through ``plugtrain eval``), HellaSwag's format, the
shipped cloze, and ``plugtrain eval`` against the plugin's logged numbers."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from plugtrain.cli import main
from plugtrain.commands.generate import load
from plugtrain.commands.train import train
from plugtrain.config import ParallelismConfig
from plugtrain.data import Tokenizer
from plugtrain.distributed import init_parallel_dims
from plugtrain.errors import DataError, MissingFileError
from plugtrain.evaluation import (
    ItemScore,
    Score,
    encode_tasks,
    read_task,
    score,
    score_items,
    wilson_interval,
)
from plugtrain.model import FLAVORS, LLAMA, Transformer, build_model
from plugtrain.testing import SAMPLE, make_trainer, read_metrics, run_distributed, tiny_args

TOKENIZER = Tokenizer.from_file(SAMPLE / "tokenizer.json")
ARGS = replace(FLAVORS["tiny"], vocab_size=TOKENIZER.vocab_size)  # 64 positions
LONG = " ".join(["Full fathom five thy father lies; of his bones are coral made."] * 12)
ITEMS = [
    {"context": "ROMEO. But soft, what light", "choices": [" through", " is", " yonder"],
     "gold": 0},
    {"context": "To be, or not to be: ", "choices": ["that is", "the question", "no"], "gold": 1},
    {"context": "", "choices": ["The king", "A horse"], "gold": 1},
    {"context": LONG, "choices": ["Hark!", "Ding-dong, bell.", "Ay, and more."], "gold": 2},
    {"context": "What's in a name?\n", "choices": ["That which", "we call", "a rose", "by"],
     "gold": 3, "delimiter": ""},
    {"context": "Once more unto the breach", "choices": ["dear friends", "once more"],
     "gold": 0, "delimiter": ", "},
    {"context": "Now is the winter of our discontent", "choices": ["Made", "Glorious", "summer",
     "by this", "sun of York"], "gold": 4, "delimiter": "\n"},
    {"context": "If music be the food of love,", "choices": ["play on", "stop"], "gold": 0},
    {"context": "All the world's a stage", "choices": ["and", "all the men", "women"], "gold": 2},
]  # fmt: skip
"""Trailing whitespace, an empty context, one longer than the model, other delimiters, 2 to 5
choices: the cases of the tokenization rules."""


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


def tiny_model() -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights(0)
    return model


@torch.no_grad()
def reference_choices(model: torch.nn.Module, items: list[dict]) -> list[list[tuple[float, bool]]]:
    """Written out as lm-evaluation-harness does it, one sequence per forward: the context's
    trailing whitespace moved to the continuation, context + continuation tokenized whole, BOS
    first, the last max_seq_len + 1 tokens kept; log-softmax, and each choice's sum over the
    continuation, and whether each of its tokens is the most likely one (is_greedy)."""
    bos = [TOKENIZER.bos_id]
    results = []
    for item in items:
        choices = []
        for choice in item["choices"]:
            context = item["context"].rstrip()
            continuation = item["context"][len(context) :] + item.get("delimiter", " ") + choice
            scored = len(bos + TOKENIZER.encode(context + continuation)) - len(
                bos + TOKENIZER.encode(context)
            )
            tokens = (bos + TOKENIZER.encode(context + continuation))[-(ARGS.max_seq_len + 1) :]
            logprobs = model(torch.tensor([tokens[:-1]]))[0].log_softmax(dim=-1)
            positions = range(len(tokens) - scored, len(tokens))
            ll = sum(logprobs[p - 1, tokens[p]].item() for p in positions)
            greedy = all(logprobs[p - 1].argmax().item() == tokens[p] for p in positions)
            choices.append((ll, greedy))
        results.append(choices)
    return results


def reference(model: torch.nn.Module, items: list[dict]) -> Score:
    """:func:`reference_choices`' scores: the first highest sum (or sum per character) wins."""
    correct = correct_norm = 0
    for item, choices in zip(items, reference_choices(model, items), strict=True):
        lls = [ll for ll, _ in choices]
        normed = [ll / len(c) for ll, c in zip(lls, item["choices"], strict=True)]
        correct += lls.index(max(lls)) == item["gold"]
        correct_norm += normed.index(max(normed)) == item["gold"]
    return Score(len(items), correct, correct_norm)


class Bigram(torch.nn.Module):
    """A model whose logits are a table's row for the token read: its most likely next tokens
    are set, so that some choices are greedy continuations."""

    def __init__(self, greedy: list[list[int]]) -> None:
        super().__init__()
        table = torch.randn(
            ARGS.vocab_size, ARGS.vocab_size, generator=torch.Generator().manual_seed(0)
        )
        for row in greedy:
            for a, b in itertools.pairwise(row):
                table[a, b] = 50.0
        self.table = torch.nn.Parameter(table)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table[tokens]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("tasks") / "plays.jsonl", ITEMS)


@pytest.fixture(scope="module")
def expected(task_file) -> Score:
    return reference(tiny_model(), ITEMS)


def test_scores_equal_the_reference_whatever_the_batch(task_file, expected):
    assert 0 < expected.correct < len(ITEMS)  # the model neither gets all nor none right
    encoded = encode_tasks([read_task(str(task_file))], TOKENIZER, ARGS.max_seq_len)
    model = tiny_model()
    for batch_size in (1, 3, 64):
        assert score(model, encoded, batch_size=batch_size) == {"plays": expected}


def test_each_choice_s_log_likelihood_and_greediness_are_the_reference_s(task_file):
    encoded = encode_tasks([read_task(str(task_file))], TOKENIZER, ARGS.max_seq_len)
    # A model whose most likely continuations are item 0's choice 0 and item 2's choice 1.
    chosen = {(0, 0), (2, 1)}
    chains = [
        row[-scored - 1 :]
        for row, scored, item, choice in zip(
            encoded.rows, encoded.scored, encoded.row_item, encoded.row_choice, strict=True
        )
        if (item, choice) in chosen
    ]
    for model in (tiny_model(), Bigram(chains)):
        want = reference_choices(model, ITEMS)
        scores, items = score_items(model, encoded, batch_size=3)
        assert scores == {"plays": reference(model, ITEMS)}
        assert [(i.task, i.index) for i in items] == [(0, n) for n in range(len(ITEMS))]
        for item, choices, doc in zip(items, want, ITEMS, strict=True):
            assert [g for _, g in item.choices] == [g for _, g in choices]
            assert [ll for ll, _ in item.choices] == pytest.approx(
                [ll for ll, _ in choices], abs=1e-4, rel=0
            )
            lls = [ll for ll, _ in choices]
            assert item.acc == (lls.index(max(lls)) == doc["gold"])
    greedy = {(i, j) for i, c in enumerate(want) for j, (_, g) in enumerate(c) if g}
    assert greedy == chosen  # the bigram's chains did not overwrite each other


def _score_on_rank(task_file: str) -> tuple[Score, list[ItemScore]]:
    dims = init_parallel_dims("cpu", ParallelismConfig())
    model = build_model(
        LLAMA, ARGS, dims.get_mesh("dp"), torch.float32, torch.float32, dims.device, seed=0
    )
    encoded = encode_tasks([read_task(task_file)], TOKENIZER, ARGS.max_seq_len)
    # Batches of 2: rank 0 has 5 items' choices, rank 1 four: rank 1 runs a padding forward.
    scores, items = score_items(
        model, encoded, batch_size=2, rank=dims.rank, world_size=dims.world_size
    )
    return scores["plays"], items


@pytest.mark.slow
def test_two_sharded_processes_give_the_reference_scores(task_file, expected):
    (first, items), (second, theirs) = run_distributed(_score_on_rank, 2, str(task_file))
    assert first == second == expected
    assert items == theirs  # every rank holds every item's choices, its own and the other's
    got = [c for i in items for c in i.choices]
    want = [c for choices in reference_choices(tiny_model(), ITEMS) for c in choices]
    assert [g for _, g in got] == [g for _, g in want]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in want], abs=1e-4, rel=0)


def test_a_hellaswag_line_is_read_as_lm_eval_preprocesses_it(tmp_path):
    line = {
        "ind": 24, "activity_label": "Roof shingle removal",
        "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
        "ctx": "A man is sitting on a roof. he",
        "endings": ["is using wrap to wrap a pair of skis.",
                    "starts pulling up roofing [title] on a roof.",
                    "is ripping  level tiles off.", "is holding a rubik's cube."],
        "label": "3", "split": "val",
    }  # fmt: skip
    (item,) = read_task(str(write_jsonl(tmp_path / "hellaswag_val.jsonl", [line]))).items
    assert item.context == "Roof shingle removal: A man is sitting on a roof. He"
    assert item.choices[1:3] == (
        "starts pulling up roofing. on a roof.",
        "is ripping level tiles off.",
    )
    assert (item.gold, item.delimiter) == (3, " ")


BAD_LINES = [
    ('{"context": "a", "choices": ["b", "c"], "gold": 0}\n{"context": "a", "choices": [\n',
     r"task file '.*bad\.jsonl' line 2 is not valid JSON"),
    ('{"context": "a", "choices": ["b", "c"], "gold": 2}\n',
     r"line 1: gold 2 is not the index of one of its 2 choices \(0 to 1\)"),
    ('{"context": "a", "choices": [], "gold": 0}\n', r"line 1 has 0 choice\(s\): give at least 2"),
    ('{"context": "a", "choices": ["b", ""], "gold": 0}\n', r"line 1: choice 1 is empty"),
    ('{"context": "a", "gold": 0}\n', r"line 1 has no 'choices'"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "message"), BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_a_bad_task_line_is_one_error_naming_the_file_and_line(tmp_path, text, message):
    (tmp_path / "bad.jsonl").write_text(text)
    with pytest.raises(DataError, match=message) as e:
        read_task(str(tmp_path / "bad.jsonl"))
    assert "\n" not in str(e.value)
    with pytest.raises(MissingFileError, match=r"task file 'nope\.jsonl' not found"):
        read_task("nope.jsonl")


def test_bad_task_files_stop_a_run_before_step_1_and_plugtrain_eval(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": ["b", "c"], "gold": 5}\n')
    for task in (str(bad), str(tmp_path / "missing.jsonl")):
        args = tiny_args(tmp_path / "run", "--plugins.enabled", "downstream_eval",
                         "--downstream_eval.tasks", json.dumps([task]),
                         "--validation.interval", "1")  # fmt: skip
        assert train(args) == 2
        assert main(["eval", str(tmp_path / "run"), "--tasks", task]) == 2
        errors = capsys.readouterr().err.strip().splitlines()
        assert len(errors) == 2 and all(task in line for line in errors), errors
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    # A folder that is not there for the per-item records: said before the model is read.
    argv = ["eval", "nowhere", "--tasks", "sample:cloze.jsonl", "--log-samples", "no/s.jsonl"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "plugtrain: error: --log-samples 'no/s.jsonl': folder 'no' does not exist: create it, "
        "or give another path\n"
    )


@pytest.mark.slow
def test_the_untrained_model_is_at_chance_on_the_shipped_cloze():
    task = read_task("sample:cloze.jsonl")
    assert len(task.items) == 400 and {len(item.choices) for item in task.items} == {4}
    result = score(tiny_model(), encode_tasks([task], TOKENIZER, ARGS.max_seq_len))["cloze"]
    low, high = wilson_interval(100, 400)  # chance: 1 in 4
    assert low <= result.acc <= high and low <= result.acc_norm <= high


def test_plugtrain_eval_of_a_checkpoint_and_its_export_gives_the_logged_scores(tmp_path, task_file):
    run = tmp_path / "run"
    args = tiny_args(run, "--plugins.enabled", "downstream_eval",
                     "--downstream_eval.tasks", json.dumps([str(task_file)]),
                     "--downstream_eval.batch_size", "4", "--validation.interval", "2",
                     "--validation.steps", "1", "--data.validation_path",
                     str(SAMPLE / "validation.jsonl"), "--checkpoint.enable", "true",
                     "--optimizer.lr", "0.05", steps=2)  # fmt: skip
    assert train(args) == 0
    (logged,) = [r for r in read_metrics(run) if "downstream_eval/plays/acc" in r]
    out, samples = tmp_path / "scores.json", tmp_path / "samples.jsonl"
    argv = ["eval", str(run), "--tasks", str(task_file), "-o", str(out)]
    assert main([*argv, "--log-samples", str(samples)]) == 0
    scores = json.loads(out.read_text())["tasks"]["plays"]
    assert scores["items"] == len(ITEMS)
    assert (scores["acc"], scores["acc_norm"]) == (
        logged["downstream_eval/plays/acc"],
        logged["downstream_eval/plays/acc_norm"],
    )
    # Each item's choices, as the reference scores them on the saved model.
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    want = reference_choices(load(run, torch.device("cpu"))[0], ITEMS)
    assert [(r["task"], r["doc_id"], r["target"]) for r in records] == [
        ("plays", i, item["gold"]) for i, item in enumerate(ITEMS)
    ]
    for record, choices, item in zip(records, want, ITEMS, strict=True):
        delimiter = item.get("delimiter", " ")
        assert record["arguments"] == [[item["context"], delimiter + c] for c in item["choices"]]
        assert record["resps"] == [[response] for response in record["filtered_resps"]]
        assert [g for _, g in record["filtered_resps"]] == [g for _, g in choices]
        assert [ll for ll, _ in record["filtered_resps"]] == pytest.approx(
            [ll for ll, _ in choices], abs=1e-4, rel=0
        )
    assert sum(r["acc"] for r in records) == round(scores["acc"] * len(ITEMS))
    assert sum(r["acc_norm"] for r in records) == round(scores["acc_norm"] * len(ITEMS))
    # The same weights exported to a Hugging Face folder score the same.
    hf, out_hf = tmp_path / "hf", tmp_path / "scores_hf.json"
    assert main(["export-hf", str(run), "-o", str(hf), "--dtype", "float32"]) == 0
    assert main(["eval", str(hf), "--tasks", str(task_file), "-o", str(out_hf)]) == 0
    assert json.loads(out_hf.read_text())["tasks"]["plays"] == scores


@pytest.mark.slow
def test_a_model_trained_on_the_true_lines_is_above_chance(tmp_path):
    # The score must move when the model learns: 60 steps of the tiny model on the first 40
    # items' contexts with their true next lines (the default run's figures, where the debug
    # model learns from other plays, are in docs/benchmarks/generation-and-eval.md).
    task = read_task("sample:cloze.jsonl")
    items = task.items[:40]
    texts = [{"text": f"{i.context}{i.delimiter}{i.choices[i.gold]}"} for i in items]
    data = write_jsonl(tmp_path / "lines.jsonl", texts)
    trainer = make_trainer(tmp_path / "run", "--data.train_path", str(data),
                           "--training.seq_len", "64", "--training.batch_size", "16",
                           "--optimizer.lr", "0.01", "--metrics.log_freq", "100",
                           steps=60)  # fmt: skip
    encoded = encode_tasks([replace(task, items=items)], TOKENIZER, ARGS.max_seq_len)
    before = score(trainer.model, encoded)["cloze"]
    trainer.run()
    after = score(trainer.model, encoded)["cloze"]
    low, high = wilson_interval(10, 40)  # chance: 1 in 4
    assert low <= before.acc <= high < after.acc
