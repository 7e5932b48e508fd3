"""Training runs with checkpoints on a real S3 server (127.0.0.1): resume bit for bit after a
kill mid-upload, a store that fails mid-save, one that is unreachable at start, no secret
written; export-hf, generate, eval and the initial load reading the checkpoint from its URL.
One set of runs (the ``runs`` fixture) serves every assert of the first tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plugtrain.checkpoint import checkpoint_folder, complete_checkpoints, read_checkpoint
from plugtrain.checkpoint.faults import FAULT_ENV
from plugtrain.checkpoint.initial import open_initial_load
from plugtrain.checkpoint.object_store import MARKER, open_storage
from plugtrain.cli import main
from plugtrain.commands.generate import from_checkpoint, load
from plugtrain.commands.train import train
from plugtrain.config import CheckpointConfig
from plugtrain.errors import CheckpointError
from plugtrain.model import Transformer
from plugtrain.plugin import hookimpl
from plugtrain.testing import free_port, make_trainer, read_metrics, tiny_args
from plugtrain.testing.hf import hf_llama_logits

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
CHECKPOINTS = ["--checkpoint.enable", "true", "--checkpoint.interval", "2",
               "--checkpoint.keep_latest_k", "2"]  # fmt: skip


def s3_args(server, prefix: str, local: Path, *extra: str) -> list[str]:
    """A tiny run's arguments with its checkpoints at ``prefix`` of ``server``."""
    return [*CHECKPOINTS, "--job.local_folder", str(local), "--checkpoint.endpoint_url",
            server.endpoint, *extra]  # fmt: skip


@pytest.fixture(scope="module")
def runs(s3_server, tmp_path_factory):
    """The uninterrupted run on the local disk; the same run on S3 in async mode, killed by
    SIGKILL while its step-4 checkpoint is uploaded (not yet marked), then resumed."""
    root = tmp_path_factory.mktemp("s3runs")
    reference = root / "reference"
    make_trainer(reference, *CHECKPOINTS, steps=STEPS).run()
    url, local = s3_server.url("resumed"), root / "resumed"
    args = tiny_args(url, *s3_args(s3_server, "resumed", local, "--checkpoint.async_mode",
                                   "async"), steps=STEPS)  # fmt: skip
    killed = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, FAULT_ENV: "before_commit:4:0", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    fs = s3_server.filesystem()
    after_kill = sorted(p.split("/checkpoints/")[1] for p in fs.find(f"{s3_server.bucket}/resumed"))
    make_trainer(url, *s3_args(s3_server, "resumed", local), steps=STEPS).run()
    return {
        "reference": reference, "url": url, "local": local, "killed": killed,
        "after_kill": after_kill, "root": root,
    }  # fmt: skip


def test_a_kill_mid_upload_leaves_an_unmarked_checkpoint_that_resume_ignores(runs):
    assert runs["killed"].returncode == -9
    steps = {p.split("/")[0] for p in runs["after_kill"]}
    assert steps == {"step-2", "step-4"}
    assert f"step-2/{MARKER}" in runs["after_kill"] and f"step-4/{MARKER}" not in runs["after_kill"]


def test_the_resumed_run_ends_bit_for_bit_as_the_uninterrupted_one(runs, s3_server):
    storage = open_storage(runs["url"], s3_server.endpoint)
    assert storage.steps() == [4, 6]  # keep_latest_k 2; the killed step-4 was cleaned, redone
    ours = read_checkpoint(storage.where(6), reader=storage.reader(6))
    reference = complete_checkpoints(checkpoint_folder(runs["reference"]))[STEPS]
    theirs = read_checkpoint(reference)
    assert ours.keys() == theirs.keys()
    # Same dtypes and values (no NaN in this run, so equal values are equal bits).
    differing = [k for k, t in ours.items() if t.dtype != theirs[k].dtype or not t.equal(theirs[k])]
    assert differing == []
    losses = [(r["step"], r["loss"]) for r in read_metrics(runs["local"]) if "loss" in r]
    expected = [(r["step"], r["loss"]) for r in read_metrics(runs["reference"]) if "loss" in r]
    assert losses == expected


def test_the_run_records_say_where_the_checkpoints_went(runs):
    import json

    run = json.loads((runs["local"] / "run.json").read_text())
    assert run["checkpoints"] == f"{runs['url']}/checkpoints"
    assert run["resumed_from"] == {"path": f"{runs['url']}/checkpoints/step-2", "step": 2}
    saved = "checkpoint step-2 saved in "
    assert saved in runs["killed"].stderr
    assert f"MiB: {runs['url']}/checkpoints/step-2\n" in runs["killed"].stderr


def test_every_checkpoint_reader_takes_the_url_as_the_local_copy(runs, tmp_path, capsys):
    # The S3 run's step-6 is bitwise the reference's (above): export-hf, generate, eval and the
    # initial load give from its URLs (the dump folder's, the step's) what they give from disk.
    url, reference = runs["url"], runs["reference"]
    hf = tmp_path / "hf"
    assert main(["export-hf", url, "-o", str(hf), "--dtype", "float32"]) == 0
    tokens = torch.tensor([list(range(1, 33))])
    model, _ = load(reference)
    with torch.no_grad():
        assert (hf_llama_logits(hf, tokens) - model(tokens)).abs().max().item() < 1e-5
    paths = (url, f"{url}/checkpoints/step-{STEPS}", str(reference))
    capsys.readouterr()
    texts = [
        main(["generate", path, "--prompt", "ROMEO:", "--max-new-tokens", "8"])
        or capsys.readouterr().out
        for path in paths
    ]
    assert texts[0] == texts[1] == texts[2] != ""
    scores = []
    for i, path in enumerate(paths):
        out = tmp_path / f"scores{i}.json"
        task = ["--tasks", "sample:cloze.jsonl", "--max-items", "8", "-o", str(out)]
        assert main(["eval", path, *task]) == 0
        scores.append(json.loads(out.read_text())["tasks"])
    assert scores[0] == scores[1] == scores[2]
    initial = open_initial_load(CheckpointConfig(initial_load_path=paths[1]))
    initial.check(model, model.args, "tokenizer")
    fresh = Transformer(model.args)
    initial.load(fresh, None, model.args)
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in fresh.state_dict().items())
    assert initial.record()["path"] == paths[1] and initial.record()["step"] == STEPS


def test_a_url_without_a_complete_checkpoint_is_refused_in_one_line(s3_server):
    unmarked = s3_server.url("unmarked/checkpoints/step-9")
    s3_server.filesystem().pipe(f"{unmarked.removeprefix('s3://')}/.metadata", b"")
    for path, message in (
        (
            unmarked,
            "is no complete checkpoint (missing; or being written, or left by a crash: on "
            "an object store it has no .committed marker)",
        ),
        (s3_server.url("unmarked"), "no checkpoint at 's3://"),
    ):
        with pytest.raises(CheckpointError, match=re.escape(message)) as e:
            from_checkpoint(path)
        assert "\n" not in str(e.value)


def test_no_credential_is_written_anywhere(runs, s3_server):
    texts = [runs["killed"].stdout, runs["killed"].stderr]
    texts += [p.read_bytes().decode("latin-1") for p in runs["root"].rglob("*") if p.is_file()]
    fs = s3_server.filesystem()
    texts += [fs.cat_file(p).decode("latin-1") for p in fs.find(s3_server.bucket)]
    for value in (s3_server.secret, s3_server.key_id):
        assert [t[:80] for t in texts if value in t] == []


class StopStoreAfter:
    """Stops the S3 server once the checkpoint of ``step`` is saved: the next save finds the
    store gone."""

    def __init__(self, server, step: int) -> None:
        self.server, self.step = server, step

    @hookimpl
    def checkpoint_saved(self, step: int) -> None:
        if step == self.step:
            self.server.stop()


def test_a_store_failing_mid_save_stops_the_run_in_one_line_and_keeps_the_last(s3_server, tmp_path):
    url = s3_server.url("failing")
    trainer = make_trainer(
        url, *s3_args(s3_server, "failing", tmp_path, "--checkpoint.store_retries", "1"),
        steps=STEPS, plugins=[("stop_store", StopStoreAfter(s3_server, 2))],
    )  # fmt: skip
    try:
        with pytest.raises(CheckpointError) as e:
            trainer.run()
    finally:
        s3_server.start()
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"cannot save checkpoint {url}/checkpoints/step-4: ")
    assert "failed 2 times" in message and "previous checkpoints are intact" in message
    storage = open_storage(url, s3_server.endpoint)
    assert storage.steps() == [2]
    storage.clean()  # what the failed save could not remove with the store away
    assert {p.split("/")[-2] for p in s3_server.filesystem().find(storage.root)} == {"step-2"}


def test_an_unreachable_store_is_refused_before_step_1(s3_server, tmp_path, capsys):
    url = s3_server.url("unreachable")
    dead = f"http://127.0.0.1:{free_port()}"
    args = tiny_args(url, *CHECKPOINTS, "--job.local_folder", str(tmp_path),
                     "--checkpoint.endpoint_url", dead)  # fmt: skip
    assert train(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"plugtrain: error: cannot reach the checkpoint store {url}/")
    assert dead in err[-1] and s3_server.secret not in err[-1]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_run_without_checkpoint_enable_saves_its_last_step_to_the_url(
    s3_server, tmp_path, capsys
):
    url = s3_server.url("final")
    args = tiny_args(url, "--checkpoint.save_final", "true", "--job.local_folder", str(tmp_path),
                     "--checkpoint.endpoint_url", s3_server.endpoint, steps=2)  # fmt: skip
    assert train(args) == 0
    assert open_storage(url, s3_server.endpoint).steps() == [2]
    err = capsys.readouterr().err
    assert f"INFO checkpoint {url}/checkpoints/step-2; metrics {tmp_path}/metrics.jsonl\n" in err
    assert f"INFO next: AWS_ENDPOINT_URL_S3={s3_server.endpoint} plugtrain generate {url} " in err
    assert json.loads((tmp_path / "run.json").read_text())["checkpoints"] == f"{url}/checkpoints"
    assert train(args) == 2  # a second such run would save beside it
    assert f"but {url}/checkpoints holds checkpoints of an earlier run (steps 2): add" in (
        capsys.readouterr().err
    )


def test_the_docs_try_it_locally_block_runs_as_written(doc_block, repo, train_py, tmp_path):
    """docs/checkpoints.md's moto block, pasted into bash in a fresh folder (on a free port):
    a run to the bucket, its resume from there, the checkpoints listed and read back."""
    block = doc_block(repo / "docs" / "checkpoints.md", "s3 locally")
    port = free_port()
    (tmp_path / "train.py").symlink_to(train_py)
    # The block's own python and moto_server; its server stopped even if a command fails.
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    script = "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + block.replace("5000", str(port))
    result = subprocess.run(
        ["bash", "-e", "-c", script], cwd=tmp_path, capture_output=True, text=True,
        env={**os.environ, "PATH": path, "PYTHONUNBUFFERED": "1"}, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    url = "s3://my-bucket/runs/try/checkpoints"
    assert f"resumed from {url}/step-4 (step 4," in result.stderr
    listed = re.findall(r"'my-bucket/runs/try/checkpoints/(step-\d+)'", result.stdout)
    assert listed == ["step-2", "step-4", "step-6"], result.stdout
    assert max(r["step"] for r in read_metrics(tmp_path / "outputs" / "try")) == 6
