"""An export scored by lm-evaluation-harness (``--model hf``) gives ``plugtrain eval``'s numbers.

The real harness runs offline on a local JSONL task built from the shipped cloze, plus items
that take lm-eval's other paths (an empty context, one that starts with BOS's text): per-choice
log-likelihoods agree within 1e-4 and acc / acc_norm are the same, whether lm-eval is told
``add_bos_token=True`` or left to the exported tokenizer's default. ``plugtrain eval
--log-samples`` writes the records lm-eval's ``log_samples`` gives, value for value.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugtrain.cli import main
from plugtrain.testing import SAMPLE, tiny_run

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's --model hf needs it

TASK = "plugtrain_cloze"
DELIMITER = "\n"
"""The shipped cloze's delimiter (every item's): lm-eval's ``target_delimiter`` is per task."""
DOCS = Path(__file__).resolve().parents[1] / "docs" / "evaluation.md"


def task_yaml(items: Path) -> str:
    """docs/evaluation.md's lm-eval task for the shipped cloze, reading ``items`` instead: the
    recipe the page gives is the one this test runs."""
    text = DOCS.read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert f"task: {TASK}\n" in block and "    test: cloze.jsonl\n" in block
    assert f"target_delimiter: {json.dumps(DELIMITER)}\n" in block
    return block.replace("    test: cloze.jsonl\n", f"    test: {items}\n")


def items() -> list[dict]:
    shipped = [json.loads(line) for line in (SAMPLE / "cloze.jsonl").read_text().splitlines()]
    assert {item["delimiter"] for item in shipped} == {DELIMITER}
    return [
        *shipped[:6],
        {"context": "", "choices": ["The king", "A fool"], "gold": 0},
        {
            "context": "<|begin_of_text|>What say you? ",
            "choices": ["Nothing", "My lord"],
            "gold": 1,
        },
    ]


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> dict:
    """One export of a tiny trained run, scored by plugtrain and by lm-eval (twice)."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    tiny_run(tmp / "run", "--checkpoint.enable", "true", steps=2)
    export = tmp / "hf"
    assert main(["export-hf", str(tmp / "run"), "-o", str(export), "--dtype", "float32"]) == 0
    task = tmp / "task"
    task.mkdir()
    path = task / "items.jsonl"
    path.write_text("".join(json.dumps({**i, "delimiter": DELIMITER}) + "\n" for i in items()))
    (task / "task.yaml").write_text(task_yaml(path))

    out, samples = tmp / "eval.json", tmp / "samples.jsonl"
    argv = ["eval", str(export), "--tasks", str(path), "-o", str(out)]
    assert main([*argv, "--log-samples", str(samples)]) == 0
    ours = json.loads(out.read_text())["tasks"]["items"]
    records = [json.loads(line) for line in samples.read_text().splitlines()]

    theirs = {}
    with pytest.MonkeyPatch.context() as env:
        # Offline, with the datasets cache in the test's folder: read when datasets is imported.
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_DATASETS_CACHE", str(tmp / "datasets"))
        env.setenv("TOKENIZERS_PARALLELISM", "false")
        import lm_eval
        from lm_eval.tasks import TaskManager

        # One index of lm-eval's task folders for both runs: building it takes seconds.
        tasks = TaskManager(include_path=str(task))
        for bos in ("", ",add_bos_token=True"):
            result = lm_eval.simple_evaluate(
                model="hf",
                model_args=f"pretrained={export},dtype=float32{bos}",
                tasks=[TASK],
                task_manager=tasks,
                device="cpu",
                batch_size=8,
                log_samples=True,
            )
            theirs[bos] = {
                "acc": result["results"][TASK]["acc,none"],
                "acc_norm": result["results"][TASK]["acc_norm,none"],
                "samples": sorted(result["samples"][TASK], key=lambda s: s["doc_id"]),
            }
    return {"export": export, "ours": ours, "records": records, "theirs": theirs}


@pytest.mark.slow
@pytest.mark.parametrize("bos", ["", ",add_bos_token=True"], ids=["default", "add_bos_token"])
def test_lm_eval_scores_the_export_as_plugtrain_eval_does(scored, bos):
    theirs, ours = scored["theirs"][bos], scored["ours"]
    assert len(theirs["samples"]) == len(scored["records"]) == len(items())
    for record, sample in zip(scored["records"], theirs["samples"], strict=True):
        got = [ll for ll, _ in sample["filtered_resps"]]
        assert got == pytest.approx([ll for ll, _ in record["filtered_resps"]], abs=1e-4, rel=0)
    assert (theirs["acc"], theirs["acc_norm"]) == (ours["acc"], ours["acc_norm"])


@pytest.mark.slow
@pytest.mark.parametrize("bos", ["", ",add_bos_token=True"], ids=["default", "add_bos_token"])
def test_log_samples_are_lm_eval_s_records(scored, bos):
    for record, sample in zip(scored["records"], scored["theirs"][bos]["samples"], strict=True):
        # The same keys (and the task's name, as one file holds every task)...
        assert list(record) == ["task", *sample]
        # ...the same values, JSON's lists for lm-eval's tuples...
        same = ["doc_id", "doc", "target", "filter", "metrics", "doc_hash", "prompt_hash"]
        same += ["target_hash", "acc", "acc_norm"]
        assert {k: record[k] for k in same} == {k: sample[k] for k in same}
        assert record["arguments"] == [list(request) for request in sample["arguments"]]
        # ...and each choice's [loglikelihood, is_greedy], within the tolerance above.
        for ours, theirs in zip(record["resps"], sample["resps"], strict=True):
            ((ll, greedy),), ((their_ll, their_greedy),) = ours, theirs
            assert (ll, greedy) == (pytest.approx(their_ll, abs=1e-4, rel=0), their_greedy)
        assert record["filtered_resps"] == [r for (r,) in record["resps"]]
