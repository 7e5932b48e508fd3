"""A real Hugging Face Qwen3-MoE folder into the moe family and back, judged by transformers.

The folder is saved by transformers itself (``plugtrain.testing.hf_qwen3_moe_folder``: one dense
block, two of 8 experts top-2, ``head_dim`` apart from the width); the import must give
transformers' logits, greedy text and first training loss, the export its tensors back bit for
bit, and a Qwen3-MoE folder given to the llama family (or a Llama one to moe) is one line.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from plugtrain import sample
from plugtrain.checkpoint.export import write_hf_folder
from plugtrain.cli import main
from plugtrain.commands.generate import load
from plugtrain.data import Tokenizer
from plugtrain.model import MOE, cross_entropy, read_hf_config
from plugtrain.model.decoding import generate
from plugtrain.model.moe import MoETransformer
from plugtrain.model.moe.hf import from_hf, model_args_from_hf
from plugtrain.testing import (
    hf_llama_folder,
    hf_logits,
    hf_qwen3_moe_folder,
    hf_tensors,
    make_trainer,
    tiny_args,
)

transformers = pytest.importorskip("transformers")

PROMPT = "ROMEO:"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_qwen3_moe_folder(tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    tokenizer = Tokenizer.from_file(sample.resolve("sample:tokenizer.json"))
    text = " ".join(
        json.loads(line)["text"] for line in sample.resolve("sample:validation.jsonl").open()
    )
    return torch.tensor(tokenizer.encode(text)[: 2 * 96]).view(2, 96)


def _import(folder, *, permute: bool = True) -> MoETransformer:
    args = model_args_from_hf(read_hf_config(folder))
    state = dict(from_hf(k, v, args, permute=permute) for k, v in hf_tensors(folder).items())
    model = MoETransformer(args)
    model.load_state_dict(MOE.hf.stack(state))
    return model.eval()


def test_the_import_gives_transformers_logits_and_without_the_permutation_not(folder, tokens):
    expected = hf_logits(folder, tokens)
    with torch.no_grad():
        ours = _import(folder)(tokens)
        unpermuted = _import(folder, permute=False)(tokens)
    assert (ours - expected).abs().max() < 1e-5
    assert (unpermuted - expected).abs().max() > 1e-2


def test_import_then_export_gives_the_tensors_back_bitwise(folder, tokens, tmp_path):
    model = _import(folder)
    out = write_hf_folder(
        tmp_path / "export",
        model.args,
        model.state_dict().__getitem__,
        hf=MOE.hf,
        tokenizer_path=folder / "tokenizer.json",
        dtype=torch.float32,
        max_shard_size=200_000,  # sharded: a layer's experts may span files
    )
    theirs, ours = hf_tensors(folder), hf_tensors(out)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], tensor) for name, tensor in theirs.items())
    assert model_args_from_hf(read_hf_config(out)) == model.args
    assert torch.equal(hf_logits(out, tokens), hf_logits(folder, tokens))


def test_generate_writes_transformers_greedy_text(folder, capsys):
    options = ("--prompt", PROMPT, "--max-new-tokens", "24", "--device", "cpu")
    assert main(["generate", str(folder), *options]) == 0
    ours = capsys.readouterr().out
    model, tokenizer = load(folder)
    prompt = torch.tensor([[tokenizer.bos_id, *tokenizer.encode(PROMPT)]])
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32)
    theirs = hf.generate(
        prompt, do_sample=False, max_new_tokens=24, min_new_tokens=24, eos_token_id=None
    )[:, prompt.shape[1] :]
    assert generate(model, prompt, 24).tolist() == theirs.tolist()
    assert ours == tokenizer.decode(theirs[0].tolist()) + "\n"


def test_the_first_training_loss_is_transformers_loss_on_the_batch(folder, tmp_path):
    trainer = make_trainer(
        tmp_path,
        *("--model.family", "moe", "--model.flavor", "hf", "--model.tokenizer_path", ""),
        *("--checkpoint.initial_load_path", str(folder)),
    )
    first = trainer.batches.next_batch()
    ((inputs, targets, *_),) = first
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = cross_entropy(hf(inputs).logits, targets).item()
    loss = trainer.train_step(first)[0].item()
    trainer.close()
    assert abs(loss - expected) / expected < 1e-5
    assert loss - math.log(2048) > 0.1  # the folder's weights, not an initialised model's


@pytest.mark.parametrize(
    ("family", "make", "message"),
    [
        (
            "llama",
            hf_qwen3_moe_folder,
            "holds a 'qwen3_moe' model, which is family 'moe', but model.family is 'llama': set "
            'model.family = "moe"',
        ),
        (
            "moe",
            hf_llama_folder,
            "holds a 'llama' model, which is family 'llama', but model.family is 'moe': set "
            'model.family = "llama"',
        ),
    ],
)
@pytest.mark.parametrize("flavor", ["hf", "given"])
def test_a_folder_of_the_other_family_is_one_line_and_exit_2(
    tmp_path, capsys, family, make, message, flavor
):
    other = make(tmp_path / "folder")
    given = {"llama": "tiny", "moe": "debug_moe"}[family]
    argv = tiny_args(
        tmp_path / "run",
        *("--model.family", family, "--model.flavor", given if flavor == "given" else "hf"),
        *("--checkpoint.initial_load_path", str(other), "--model.tokenizer_path", ""),
    )
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(message), err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_trained_run_exports_a_folder_transformers_reads_and_eval_scores_alike(tmp_path):
    run = tmp_path / "run"
    make_trainer(
        run, "--model.family", "moe", "--model.flavor", "debug_moe",
        "--checkpoint.save_final", "true", steps=2,
    ).run()  # fmt: skip
    folder = tmp_path / "hf"
    assert main(["export-hf", str(run), "-o", str(folder), "--dtype", "float32"]) == 0
    assert read_hf_config(folder)["architectures"] == ["Qwen3MoeForCausalLM"]
    model, _ = load(run)
    tokens = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf_logits(folder, tokens)).abs().max() < 1e-5
    scores = {}
    for source in (run, folder):
        out = tmp_path / f"{source.name}.json"
        task = ["--tasks", "sample:cloze.jsonl", "--max-items", "8", "-o", str(out)]
        assert main(["eval", str(source), *task]) == 0
        scores[source.name] = json.loads(out.read_text())["tasks"]
    assert scores["run"] == scores["hf"]
