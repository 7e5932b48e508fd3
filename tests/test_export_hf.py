"""``plugtrain export-hf``: a checkpoint as a Hugging Face folder, checked with transformers."""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import shutil
from pathlib import Path

import pytest
import tokenizers
import torch
import torch.distributed.checkpoint as dcp

from plugtrain.checkpoint import export
from plugtrain.checkpoint.dcp_io import read_checkpoint
from plugtrain.checkpoint.export import export_checkpoint, parse_size, write_hf_folder
from plugtrain.checkpoint.saved import locate_checkpoint, open_checkpoint
from plugtrain.cli import main
from plugtrain.data.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer
from plugtrain.model import FAMILIES, LLAMA, parameter_shapes
from plugtrain.model.llama.hf import to_hf
from plugtrain.model.llama.transformer import FLAVORS, Transformer
from plugtrain.testing import SAMPLE, tiny_run

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")


def sample_text() -> str:
    return json.loads((SAMPLE / "validation.jsonl").read_text().splitlines()[0])["text"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny run of 2 steps with the ema plugin, checkpointed at its end."""
    folder = tmp_path_factory.mktemp("export") / "run"
    tiny_run(folder, "--checkpoint.enable", "true", "--plugins.enabled", "ema", steps=2)
    return folder


@pytest.fixture(scope="module")
def fp32(run) -> Path:
    out = run.parent / "fp32"
    assert main(["export-hf", str(run), "-o", str(out), "--dtype", "float32"]) == 0
    return out


def newest(run: Path) -> Path:
    """The folder of ``run``'s latest complete checkpoint."""
    return Path(locate_checkpoint(run).location)


def plugtrain_model(checkpoint: Path) -> Transformer:
    """The checkpoint's model in plugtrain, fp32, on the CPU."""
    model = Transformer(open_checkpoint(checkpoint).args)
    model.init_weights(0)  # builds the RoPE table; every parameter is then loaded
    state = read_checkpoint(checkpoint, "model.")
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    return model


def max_logit_error(checkpoint: Path, out: Path) -> float:
    tokens = torch.tensor(
        [Tokenizer.from_file(SAMPLE / "tokenizer.json").encode(sample_text())[:64]]
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(tokens).logits
        ours = plugtrain_model(checkpoint)(tokens)
    return (theirs - ours).abs().max().item()


def tensors(out: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(out.glob("*.safetensors")):
        with safetensors.safe_open(file, "pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (not a dict)
    return found


def test_fp32_export_gives_plugtrain_logits_and_the_tokenizer(run, fp32):
    assert sorted(p.name for p in fp32.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert max_logit_error(newest(run), fp32) < 1e-5
    theirs = transformers.AutoTokenizer.from_pretrained(fp32)
    ours = Tokenizer.from_file(SAMPLE / "tokenizer.json")
    text = sample_text()
    ids = theirs.encode(text, add_special_tokens=False)
    assert ids == ours.encode(text)
    assert theirs.decode(ids) == ours.decode(ids) == text
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id)


def test_the_exported_tokenizer_puts_bos_first_as_plugtrain_does(fp32):
    """What plugtrain trains on, generates from and scores: BOS, the text's tokens, no EOS."""
    ours = Tokenizer.from_file(SAMPLE / "tokenizer.json")
    text = sample_text()
    laid_out = [ours.bos_id, *ours.encode(text)]
    for options in ({}, {"add_bos_token": True}):
        theirs = transformers.AutoTokenizer.from_pretrained(fp32, **options)
        assert theirs(text)["input_ids"] == laid_out, options
    off = transformers.AutoTokenizer.from_pretrained(fp32, add_bos_token=False)
    assert off(text)["input_ids"] == ours.encode(text)
    bare = tokenizers.Tokenizer.from_file(str(fp32 / "tokenizer.json"))  # vLLM, TGI, llama.cpp
    assert bare.encode(text).ids == laid_out
    config = json.loads((fp32 / "tokenizer_config.json").read_text())
    assert (config["add_bos_token"], config["add_eos_token"]) == (True, False)


def test_a_tokenizer_without_bos_exports_without_one(tmp_path):
    # Its own post-processor (here BERT's, adding special tokens around a text) goes: plugtrain
    # adds no special token that the data pipeline does not place.
    eos_id = Tokenizer.from_file(SAMPLE / "tokenizer.json").eos_id
    spec = json.loads((SAMPLE / "tokenizer.json").read_text().replace(BOS_TOKEN, "<|unused|>"))
    spec["post_processor"] = {
        "type": "BertProcessing",
        "sep": [EOS_TOKEN, eos_id],
        "cls": [EOS_TOKEN, eos_id],
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    ours = Tokenizer.from_file(path)
    assert ours.bos_id is None
    args = dataclasses.replace(FLAVORS["tiny"], vocab_size=ours.vocab_size, max_seq_len=16)
    shapes = parameter_shapes(args)
    zeros = lambda name: torch.zeros(shapes[name])  # noqa: E731 (the weights do not matter)
    out = write_hf_folder(
        tmp_path / "hf", args, zeros, hf=LLAMA.hf, tokenizer_path=path, dtype=torch.float32
    )
    text = sample_text()
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == ours.encode(text)
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is False


def test_export_without_the_qk_permutation_fails_the_logit_check(run, fp32, monkeypatch):
    # The negative control: the tolerance above sees a missing permutation. The export takes
    # its writer from the family's spec, so the broken writer goes there.
    unpermuted = dataclasses.replace(LLAMA.hf, to_hf=functools.partial(to_hf, permute=False))
    monkeypatch.setitem(FAMILIES, "llama", lambda: dataclasses.replace(LLAMA, hf=unpermuted))
    out = run.parent / "unpermuted"
    export_checkpoint(run, out, dtype=torch.float32)
    assert max_logit_error(newest(run), out) > 1e-5


def test_the_default_export_keeps_the_checkpoints_float32_and_says_so(run, fp32, capsys):
    out = run.parent / "default"
    assert main(["export-hf", str(run), "-o", str(out)]) == 0
    assert capsys.readouterr().out.endswith(" in float32 (the checkpoint's)\n")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"
    assert (out / "model.safetensors").read_bytes() == (fp32 / "model.safetensors").read_bytes()


def test_bf16_export_casts_every_tensor_and_says_so(run, fp32, capsys):
    out = run.parent / "bf16"
    assert main(["export-hf", str(run), "-o", str(out), "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.endswith(" in bfloat16\n")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    exported, reference = tensors(out), tensors(fp32)
    assert exported.keys() == reference.keys()
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16


def test_sharded_export_loads_the_same_model(run, fp32):
    out = run.parent / "sharded"
    argv = [
        "export-hf",
        str(run),
        "-o",
        str(out),
        "--dtype",
        "float32",
        "--max-shard-size",
        "100KB",
    ]
    assert main(argv) == 0
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for path in out.glob("*.safetensors"):  # at most 100KB of tensors, or one larger tensor
        with safetensors.safe_open(path, "pt") as f:
            assert path.stat().st_size <= 100_000 + 4096 or len(f.keys()) == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    reference = tensors(fp32)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in reference.values())
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_ema_export_writes_the_average(run):
    out = run.parent / "ema"
    assert (
        main(["export-hf", str(run), "-o", str(out), "--weights", "ema", "--dtype", "float32"]) == 0
    )
    average = read_checkpoint(newest(run), "plugins.ema.average.")
    args = plugtrain_model(newest(run)).args
    expected = dict(
        to_hf(k.removeprefix("plugins.ema.average."), v, args) for k, v in average.items()
    )
    exported = tensors(out)
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    model = read_checkpoint(newest(run), "model.")
    assert not torch.equal(
        average["plugins.ema.average.output.weight"], model["model.output.weight"]
    )


def test_parse_size():
    assert [parse_size(s) for s in ("5GB", "100kb", "2MiB", "7")] == [5 * 10**9, 10**5, 2**21, 7]
    with pytest.raises(export.UserError, match="size '5 apples' is not a positive size"):
        parse_size("5 apples")


# --------------------------------------------------------------------------- bad input


def refused(argv: list[str], capsys) -> str:
    """Run the command, check it fails with status 2 and one line; return that line."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("plugtrain: error: ") and "\n" not in err, err
    return err


def test_no_checkpoint_at_path(tmp_path, capsys):
    out = tmp_path / "out"
    err = refused(["export-hf", str(tmp_path), "-o", str(out)], capsys)
    assert f"no checkpoint at '{tmp_path}'" in err and "dump folder" in err
    assert not out.exists()


def damaged_copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "step-2"
    shutil.copytree(newest(run), copy)
    return copy


def test_damaged_checkpoint(run, tmp_path, capsys):
    copy = damaged_copy(run, tmp_path)
    shard = next(copy.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:1000])
    out = tmp_path / "out"
    err = refused(["export-hf", str(copy), "-o", str(out)], capsys)
    assert f"checkpoint '{copy}' is damaged: cannot read 'model." in err
    assert not out.exists() and not (tmp_path / "out.partial").exists()
    (copy / ".metadata").unlink()
    assert "is damaged: it has no .metadata" in refused(
        ["export-hf", str(copy), "-o", str(out)], capsys
    )


def test_checkpoint_of_a_shape_the_format_cannot_express(run, tmp_path, capsys):
    copy = damaged_copy(run, tmp_path)
    state = read_checkpoint(copy, "model.")
    state["model.layers.0.attention.wq.bias"] = torch.zeros(32)
    shutil.rmtree(copy)
    dcp.save(state, checkpoint_id=copy, no_dist=True)
    shutil.copy(newest(run) / "config.json", copy)
    err = refused(["export-hf", str(copy), "-o", str(tmp_path / "out")], capsys)
    assert (
        "tensor 'layers.0.attention.wq.bias' has no place in the Hugging Face Llama format" in err
    )
    assert not (tmp_path / "out").exists()


def test_a_missing_tokenizer_or_flavor_is_named(run, tmp_path, capsys):
    copy = damaged_copy(run, tmp_path)
    config = json.loads((copy / "config.json").read_text())
    moved = tmp_path / "elsewhere.json"
    shutil.copy(SAMPLE / "tokenizer.json", moved)
    config["model"]["tokenizer_path"] = "gone/tokenizer.json"
    (copy / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    err = refused(["export-hf", str(copy), "-o", str(out)], capsys)
    assert "tokenizer 'gone/tokenizer.json' of checkpoint" in err and "--tokenizer" in err
    assert main(["export-hf", str(copy), "-o", str(out), "--tokenizer", str(moved)]) == 0
    exported, given = (json.loads(f.read_text()) for f in (out / "tokenizer.json", moved))
    del exported["post_processor"], given["post_processor"]  # the export's puts BOS first
    assert exported == given
    config["model"]["flavor"] = "1T"
    (copy / "config.json").write_text(json.dumps(config))
    err = refused(["export-hf", str(copy), "-o", str(tmp_path / "out2")], capsys)
    assert f"checkpoint '{copy}' is of model flavor '1T', which this plugtrain does not" in err


def test_existing_output_is_kept_unless_overwrite(run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    err = refused(["export-hf", str(run), "-o", str(out)], capsys)
    assert f"'{out}' exists and is not empty" in err and "--overwrite" in err
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    assert main(["export-hf", str(run), "-o", str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").is_file() and not (out / "mine.txt").exists()


def test_full_disk_leaves_nothing(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old export")
    calls = []

    def fill_disk(f, data):
        calls.append(len(memoryview(data).cast("B")))
        if len(calls) == 3:  # two tensors in
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        f.write(data)

    monkeypatch.setattr(export, "_write", fill_disk)
    err = refused(["export-hf", str(run), "-o", str(out), "--overwrite"], capsys)
    assert f"cannot write '{out}' (disk full;" in err and "free space" in err
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no out.partial
    assert [p.name for p in out.iterdir()] == ["old.txt"]


# --------------------------------------------------------------------------- several processes


@pytest.mark.slow
def test_export_of_a_two_process_run_equals_the_one_process_export(tmp_path):
    """A checkpoint sharded over 2 ranks exports the same bytes as the same weights saved by
    one process (training itself is not bitwise across world sizes)."""
    two = tmp_path / "two"
    tiny_run(two, "--checkpoint.enable", "true", steps=2, world_size=2)
    sharded = newest(two)
    assert len(list(sharded.glob("*.distcp"))) == 2
    one = tmp_path / "one" / "step-2"
    dcp.save(read_checkpoint(sharded, "model."), checkpoint_id=one, no_dist=True)
    shutil.copy(sharded / "config.json", one)
    for source, out in ((two, tmp_path / "out-two"), (one, tmp_path / "out-one")):
        assert main(["export-hf", str(source), "-o", str(out), "--max-shard-size", "100KB"]) == 0
    files = sorted(p.name for p in (tmp_path / "out-one").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "out-two").iterdir())
    for name in files:
        assert (tmp_path / "out-two" / name).read_bytes() == (
            tmp_path / "out-one" / name
        ).read_bytes()
