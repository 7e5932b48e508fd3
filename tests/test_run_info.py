"""What a run leaves and says: its last step saved without checkpoint.enable
(``checkpoint.save_final``), the modes named at start-up and recorded in run.json, and the
summary at the end with the commands to try next."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path

import pytest
import torch

import plugtrain.cli
from plugtrain.checkpoint import complete_checkpoints, read_checkpoint
from plugtrain.cli import main
from plugtrain.commands.train import train
from plugtrain.config import JobConfig
from plugtrain.data import (
    ChatTemplate,
    DevicePrefetcher,
    PackedDataset,
    SkippingLoader,
    SkipRange,
    StatefulBatchLoader,
)
from plugtrain.distributed import ParallelDims
from plugtrain.testing import SAMPLE, make_trainer, read_metrics, run_script, tiny_args, tiny_run
from plugtrain.testing.reference import InMemoryStream, packed_documents
from plugtrain.training import configure
from plugtrain.training.run_info import (
    boundary_note,
    next_commands,
    run_setup,
    setup_lines,
    summary_lines,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # in-process trainers

FINAL = ("--checkpoint.save_final", "true")
"""What a run does by default, which the test kit's runs turn off."""


@pytest.fixture(scope="module")
def final_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step run with checkpoint.enable off, as a default run: it saves step 3 alone."""
    folder = tmp_path_factory.mktemp("final") / "run"
    tiny_run(folder, *FINAL)
    return folder


def copy_of(run: Path, tmp_path: Path) -> Path:
    """A copy of ``run``'s dump folder, for a test that writes to it."""
    return Path(shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns(".*lock")))


# -- checkpoint.save_final ---------------------------------------------------------------------


def test_the_last_step_is_saved_as_a_periodic_checkpoint_is(final_run, tmp_path, capsys):
    checkpoints = complete_checkpoints(final_run / "checkpoints")
    assert list(checkpoints) == [3]
    # Bit for bit what checkpoint.enable saves at the same step: model, optimizer, data, RNGs.
    tiny_run(tmp_path, "--checkpoint.enable", "true")
    saved, periodic = (
        read_checkpoint(checkpoints[3]),
        read_checkpoint(tmp_path / "checkpoints" / "step-3"),
    )
    assert saved.keys() == periodic.keys() and any(k.startswith("optimizer.") for k in saved)
    assert [k for k, t in saved.items() if not torch.equal(t, periodic[k])] == []
    capsys.readouterr()
    assert main(["generate", str(final_run), "--prompt", "ROMEO:", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.strip()


def test_checkpoint_enable_resumes_from_it(final_run, tmp_path):
    trainer = make_trainer(copy_of(final_run, tmp_path), "--checkpoint.enable", "true", steps=4)
    try:
        assert trainer.step == 3
    finally:
        trainer.abort()


def test_a_second_run_into_its_folder_is_refused_in_one_line(final_run, tmp_path, capsys):
    folder = copy_of(final_run, tmp_path)
    before = (folder / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert train(tiny_args(folder, *FINAL)) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"plugtrain: error: checkpoint.enable is off (start afresh, save the last step), but "
        f"{folder / 'checkpoints'} holds checkpoints of an earlier run (steps 3): add "
        "--checkpoint.enable true to resume from step 3, train in another job.dump_folder, or "
        "add --checkpoint.discard_later true to delete them"
    ]
    assert (folder / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in folder.glob("metrics*")) == ["metrics.jsonl"]
    # With save_final off it saves nothing, so nothing is refused (the kit's runs).
    assert train(tiny_args(folder, steps=2)) == 0
    assert list(complete_checkpoints(folder / "checkpoints")) == [3]
    # Asked to, it deletes them and saves its own.
    assert train(tiny_args(folder, *FINAL, "--checkpoint.discard_later", "true", steps=2)) == 0
    assert "deleted step-3 (checkpoint.discard_later)" in capsys.readouterr().err
    assert list(complete_checkpoints(folder / "checkpoints")) == [2]


def test_it_saves_once_whatever_else_saves(tmp_path):
    # Due by the interval too: one save (a second would be refused as a complete one exists).
    every = (
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "3",
        "--checkpoint.keep_latest_k",
        "1",
    )
    tiny_run(tmp_path / "interval", *FINAL, *every, steps=3)
    assert list(complete_checkpoints(tmp_path / "interval" / "checkpoints")) == [3]
    # Written in the background, committed before the run returns.
    tiny_run(tmp_path / "async", *FINAL, "--checkpoint.async_mode", "async", steps=2)
    assert list(complete_checkpoints(tmp_path / "async" / "checkpoints")) == [2]
    assert [r["step"] for r in read_metrics(tmp_path / "async")] == [1, 2]


# -- the modes, at start-up and in run.json ---------------------------------------------------


def start_up_lines(err: str) -> list[str]:
    """The lines :class:`RunInfo` logs at start-up, from a run's stderr (without the time)."""
    heads = ("attention: ", "layout: ", "loss on ", "document masking", "per-document")
    lines = [line.split(" INFO ", 1)[-1] for line in err.splitlines()]
    return [line for line in lines if line.startswith(heads)]


def test_a_chat_run_names_its_modes_and_run_json_records_them(tmp_path, capsys):
    tiny_run(tmp_path, "--data.train_path", str(SAMPLE / "chat_validation.jsonl"), steps=1)
    template = ChatTemplate.for_tokenizer(SAMPLE / "tokenizer.json")
    lines = start_up_lines(capsys.readouterr().err)
    assert lines[:3] == [
        "attention: document masking (sdpa, boolean mask); RoPE positions restart at each document",
        "layout: 1 x 1 x 1 (dp_replicate x dp_shard x tp)",
        "loss on the assistant's tokens only (data.chat_loss); chat template: plugtrain's default "
        f"chat template (sha256 {template.sha256[:12]})",
    ]
    # Packed conversations share rows: the masking takes effect.
    (note,) = lines[3:]
    assert note.startswith("document masking and per-document positions: ")
    assert note.endswith(" of the first 4 rows hold several documents")
    assert json.loads((tmp_path / "run.json").read_text())["setup"] == {
        "attention": "document",
        "attention_kernel": "sdpa, boolean mask",
        "positions": "per document",
        "layout": {"dp_replicate": 1, "dp_shard": 1, "tp": 1},
        "loss_mask": "assistant",
        "chat_template": template.record(),
    }


def test_document_masking_that_changes_nothing_says_so(tmp_path, capsys):
    # The sample's plays are far longer than a row: no row of the first batch holds two.
    tiny_run(tmp_path, "--model.attention", "document", steps=1)
    assert start_up_lines(capsys.readouterr().err) == [
        "attention: document masking (sdpa, boolean mask); RoPE positions restart at each document",
        "layout: 1 x 1 x 1 (dp_replicate x dp_shard x tp)",
        "loss on every token; chat template: none",
        "document masking and per-document positions: none of the first 4 rows crosses a "
        "document boundary, so nothing changes there (the documents are long next to "
        "training.seq_len 32)",
    ]
    setup = json.loads((tmp_path / "run.json").read_text())["setup"]
    assert (setup["loss_mask"], setup["chat_template"]) == ("none", None)


def test_the_lines_follow_the_layout_the_device_and_the_options():
    config = JobConfig()
    config.resolve_attention(chat=False)
    dims = ParallelDims(dp_replicate=2, dp_shard=3, tp=2, device=torch.device("cuda"))
    assert setup_lines(run_setup(config, dims, False, None))[:2] == [
        "attention: causal across packed documents (sdpa); RoPE positions run on across documents",
        "layout: 2 x 3 x 2 (dp_replicate x dp_shard x tp)",
    ]
    config = JobConfig()
    config.model.attention = "document"
    config.resolve_attention(chat=False)
    # On CUDA document masking runs through flex attention (model/attention.py).
    assert setup_lines(run_setup(config, dims, False, None))[0] == (
        "attention: document masking (flex attention); RoPE positions restart at each document"
    )


def test_the_layout_line_names_a_pipeline_and_context_parallelism():
    config = JobConfig()
    config.resolve_attention(chat=False)
    config.parallelism.pp_schedule, config.training.grad_accum_steps = "ZBVZeroBubble", 4
    pipelined = setup_lines(run_setup(config, ParallelDims(pp=2, dp_shard=2), False, None))[1]
    assert pipelined == (
        "layout: 1 x 2 x 1 (dp_replicate x dp_shard x tp) in each of 2 pipeline ranks "
        "(ZBVZeroBubble, 2 stage(s) per rank, 4 microbatches)"
    )
    config.parallelism.cp_method = "ulysses"
    split = setup_lines(run_setup(config, ParallelDims(dp_shard=2, cp=2), False, None))[1]
    assert split == (
        "layout: 1 x 2 x 1 (dp_replicate x dp_shard x tp), each row split over 2 "
        "context-parallel ranks (ulysses)"
    )


def test_the_docs_show_the_default_runs_lines(doc_block, repo):
    config = JobConfig()  # python train.py's
    config.resolve_attention(chat=False)
    lines = setup_lines(run_setup(config, ParallelDims(), False, None))
    assert doc_block(repo / "docs" / "observability.md", "start-up lines").splitlines() == lines


def test_the_note_counts_the_rows_that_hold_several_documents():
    one_each = packed_documents([[8], [8], [8]], vocab_size=50)
    assert boundary_note("document masking", [one_each], 8).startswith(
        "document masking: none of the first 3 rows crosses a document boundary"
    )
    two = packed_documents([[3, 5], [8]], vocab_size=50)
    positions_only = two._replace(documents=None)  # data.reset_positions without masking
    assert (
        boundary_note("x", [two, one_each], 8) == "x: 1 of the first 5 rows hold several documents"
    )
    assert (
        boundary_note("x", [positions_only], 8) == "x: 1 of the first 2 rows hold several documents"
    )


def test_a_peek_is_the_next_batch_and_moves_nothing():
    dataset = PackedDataset(InMemoryStream(torch.arange(200, dtype=torch.int32)), 3)

    def batches() -> SkippingLoader:
        loader = StatefulBatchLoader(
            dataset, global_batch_size=2, grad_accum_steps=1, rank=0, world_size=1, seed=0
        )
        return SkippingLoader(DevicePrefetcher(loader, torch.device("cpu")), [SkipRange(1, 1, "")])

    peeked, plain = batches(), batches()
    first = peeked.peek()  # batch 2: batch 1 is skipped
    assert peeked.next_batch() is first
    for _ in range(2):
        theirs = plain.next_batch()[0].inputs
        assert torch.equal(theirs, first[0].inputs)
        state, their_state = peeked.state_dict(), plain.state_dict()
        assert state.keys() == their_state.keys()
        assert all(
            torch.equal(torch.as_tensor(state[k]), torch.as_tensor(their_state[k])) for k in state
        )
        first = peeked.next_batch()


# -- the summary at the end -------------------------------------------------------------------


def summary(err: str) -> list[str]:
    """The lines that end a run, from its stderr (without the time)."""
    lines = [line.split(" INFO ", 1)[-1] for line in err.splitlines()]
    return lines[next(i for i, line in enumerate(lines) if line.startswith("run ends at ")) :]


def test_the_run_ends_with_where_it_is_and_commands_that_run_as_pasted(tmp_path, capsys):
    folder = tmp_path / "a run"  # a space, quoted in the commands
    validation = ("--validation.interval", "2", "--validation.steps", "1")
    tiny_run(folder, *FINAL, *validation, "--optimizer.lr", "0.05", steps=5)
    records = [
        (r["step"], r["validation_loss"]) for r in read_metrics(folder) if "validation_loss" in r
    ]
    assert [step for step, _ in records] == [2, 4, 5]
    last, best = records[-1], min(records, key=lambda r: r[1])
    lines = summary(capsys.readouterr().err)
    assert lines[:2] == [
        f"run ends at step 5 of 5; validation loss {last[1]:.4f} at step 5, best {best[1]:.4f} "
        f"at step {best[0]}",
        f"checkpoint {folder / 'checkpoints' / 'step-5'}; metrics {folder / 'metrics.jsonl'}",
    ]
    quoted = shlex.quote(str(folder))
    assert lines[2:] == [
        f'next: plugtrain generate {quoted} --prompt "ROMEO:"',
        f"next: plugtrain export-hf {quoted} -o {shlex.quote(f'{folder}-hf')}",
        f"next: plugtrain eval {quoted} --tasks sample:cloze.jsonl",
    ]
    argv = shlex.split(lines[2].removeprefix("next: "))
    assert main([*argv[1:], "--max-new-tokens", "4"]) == 0 and capsys.readouterr().out


def test_without_a_checkpoint_it_says_so_and_suggests_nothing(tmp_path, capsys):
    tiny_run(tmp_path, steps=2)  # the kit's runs save nothing
    assert summary(capsys.readouterr().err) == [
        "run ends at step 2 of 2; no validation loss (validation.interval is 0)",
        f"metrics {tmp_path / 'metrics.jsonl'}; no checkpoint (checkpoint.save_final saves the "
        "last step, checkpoint.enable every checkpoint.interval steps and on a stop)",
    ]


def test_the_docs_show_the_default_runs_end(doc_block, repo):
    # Its validation losses at steps 150 and 200 (docs/benchmarks/muon.md: 4.950, 4.8609).
    run = Path("outputs/run")
    lines = summary_lines(
        JobConfig(), 200, [(150, 4.95), (200, 4.8609)], run / "checkpoints" / "step-200",
        run / "metrics.jsonl", chat=False,
    )  # fmt: skip
    assert doc_block(repo / "docs" / "observability.md", "end lines").splitlines() == lines


def test_the_commands_follow_the_store_the_data_and_the_tasks(monkeypatch):
    url, local, endpoint = "s3://bucket/runs/a", "out/a b", "http://127.0.0.1:9000"
    config, _ = configure([
        "--job.dump_folder", url, "--job.local_folder", local,
        "--checkpoint.endpoint_url", endpoint,
        "--plugins.enabled", "downstream_eval",
        "--downstream_eval.tasks", "sample:cloze.jsonl,my tasks.jsonl",
    ])  # fmt: skip
    env = f"AWS_ENDPOINT_URL_S3={endpoint}"
    commands = next_commands(config, chat=True)
    assert commands == [
        f'{env} plugtrain generate {url} --chat --prompt "Hello"',
        f"{env} plugtrain export-hf {url} -o 'out/a b-hf'",
        f"{env} plugtrain eval {url} --tasks sample:cloze.jsonl 'my tasks.jsonl'",
    ]
    ran = []
    monkeypatch.setattr(plugtrain.cli, "run_cli", lambda main: ran.append(main) or 0)
    for command in commands:  # each parses as the command it names
        argv = shlex.split(command)
        assert argv[0] == env and plugtrain.cli.command(argv[2:]) == 0
    assert len(ran) == 3


@pytest.mark.slow
def test_two_processes_say_it_once_with_their_layout_and_leave_a_checkpoint(tmp_path, train_py):
    # Every rank logs (rank 1 prefixed): the run's own lines come from rank 0 alone all the same.
    args = tiny_args(tmp_path, *FINAL, "--metrics.log_all_ranks", "true", steps=2)
    result = run_script(train_py, ["--nproc-per-node", "2", *args])
    assert "[rank 1] " in result.stderr
    assert result.returncode == 0, result.stderr
    assert "for 2 steps on 2 cpu process(es)" in result.stderr  # gloo, on the loopback
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert start_up_lines(result.stderr) == [
        "attention: causal across packed documents (sdpa); RoPE positions run on across documents",
        "layout: 1 x 2 x 1 (dp_replicate x dp_shard x tp)",
        "loss on every token; chat template: none",
    ]
    setup = json.loads((tmp_path / "run.json").read_text())["setup"]
    assert setup["layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1}
    # The summary, once; its first command reads the checkpoint both ranks saved.
    lines = summary(result.stderr)
    assert [line.startswith("next: ") for line in lines] == [False] * 2 + [True] * 3
    assert lines[1].startswith(f"checkpoint {tmp_path / 'checkpoints' / 'step-2'}; ")
    assert main([*shlex.split(lines[2].removeprefix("next: "))[1:], "--max-new-tokens", "4"]) == 0
