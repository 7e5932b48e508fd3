"""The dump folder: a file, an unwritable folder or one in use by another run stops a run."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from plugtrain.commands.train import train
from plugtrain.errors import DumpFolderError
from plugtrain.testing import run_script, tiny_args
from plugtrain.training import dump_folder
from plugtrain.training.dump_folder import LOCK_FILE, claim_dump_folder
from plugtrain.training.launch import configure, run_cli
from plugtrain.training.trainer import Trainer

FIX = "set job.dump_folder to a folder you can write to"


def locked_elsewhere(folder: Path) -> bool:
    """Whether a new open file of the lock file cannot be locked (flock is per open file)."""
    fd = os.open(folder / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def test_a_dump_folder_that_is_a_file_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "run"
    path.write_text("not a folder")
    assert train(tiny_args(path)) == 2  # what train.py exits with, in this process
    assert capsys.readouterr().err.strip().splitlines() == [
        f"plugtrain: error: job.dump_folder {path} is a file, not a folder: set job.dump_folder "
        "to a folder (it is created if missing)"
    ]
    assert path.read_text() == "not a folder"


def test_a_dump_folder_under_a_file_names_the_file(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(DumpFolderError) as info:
        claim_dump_folder(tmp_path / "file" / "run")
    assert str(info.value) == (
        f"cannot create job.dump_folder {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a "
        f"file: {FIX}"
    )


def test_a_dump_folder_that_cannot_be_created_or_written(tmp_path, monkeypatch):
    # As root, permissions do not stop writes: the errors are injected.
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    with monkeypatch.context() as patch:
        patch.setattr(Path, "mkdir", refuse)
        with pytest.raises(DumpFolderError) as info:
            claim_dump_folder(tmp_path / "new")
    assert (
        str(info.value)
        == f"cannot create job.dump_folder {tmp_path / 'new'}: Permission denied: {FIX}"
    )
    monkeypatch.setattr(dump_folder.tempfile, "TemporaryFile", refuse)
    with pytest.raises(DumpFolderError) as info:
        claim_dump_folder(tmp_path)
    assert (
        str(info.value) == f"cannot write to job.dump_folder {tmp_path}: Permission denied: {FIX}"
    )
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_read_only_dump_folder(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)],
                           capture_output=True)  # fmt: skip
    if mount.returncode:
        pytest.skip(f"cannot mount a read-only tmpfs here: {mount.stderr.decode().strip()}")
    try:
        with pytest.raises(DumpFolderError) as info:
            claim_dump_folder(folder)
    finally:
        subprocess.run(["umount", str(folder)], check=True)
    assert (
        str(info.value) == f"cannot write to job.dump_folder {folder}: Read-only file system: {FIX}"
    )


def test_a_second_run_in_a_folder_in_use_stops_and_touches_nothing(tmp_path, train_py):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    lock = claim_dump_folder(tmp_path)  # the first run: this test's process
    try:
        about = json.loads((tmp_path / LOCK_FILE).read_text())
        assert (about["pid"], about["host"]) == (os.getpid(), socket.gethostname())
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
        result = run_script(train_py, tiny_args(tmp_path))
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines() == [
            f"plugtrain: error: job.dump_folder {tmp_path} is in use by another run (pid "
            f"{os.getpid()} on host {about['host']} since {about['since']}): wait for it to "
            "finish or set job.dump_folder elsewhere"
        ]
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    finally:
        lock.release()


def test_a_lock_left_by_a_killed_run_does_not_block(tmp_path, repo):
    code = (
        "import os, signal, sys; from plugtrain.training.dump_folder import claim_dump_folder; "
        "claim_dump_folder(sys.argv[1]); os.kill(os.getpid(), signal.SIGKILL)"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=repo)
    assert killed.returncode == -9
    dead_pid = json.loads((tmp_path / LOCK_FILE).read_text())["pid"]
    assert dead_pid != os.getpid()
    claim_dump_folder(tmp_path).release()


def test_the_lock_is_shared_in_a_process_and_released_by_close_and_failures(tmp_path):
    first, second = claim_dump_folder(tmp_path), claim_dump_folder(tmp_path)
    first.release()
    first.release()  # idempotent
    assert locked_elsewhere(tmp_path)
    second.release()
    assert not locked_elsewhere(tmp_path)
    # A trainer holds it until close, and gives it back when it fails to start.
    trainer = Trainer(*configure(tiny_args(tmp_path, steps=1)))
    assert locked_elsewhere(tmp_path)
    trainer.close()
    assert not locked_elsewhere(tmp_path)
    bad = [*tiny_args(tmp_path), "--data.train_path", str(tmp_path / "missing.jsonl")]
    assert run_cli(lambda: Trainer(*configure(bad))) == 2
    assert not locked_elsewhere(tmp_path)


def test_a_failed_start_removes_only_the_empty_folders_it_created(tmp_path):
    missing = ["--data.train_path", str(tmp_path / "missing.jsonl")]
    new = tmp_path / "outputs" / "run"
    assert run_cli(lambda: Trainer(*configure([*tiny_args(new), *missing]))) == 2
    assert not (tmp_path / "outputs").exists() and tmp_path.is_dir()
    # A folder that was there stays, even empty; so does one that holds anything else.
    (tmp_path / "empty").mkdir()
    assert run_cli(lambda: Trainer(*configure([*tiny_args(tmp_path / "empty"), *missing]))) == 2
    assert (tmp_path / "empty").is_dir()
    lock = claim_dump_folder(new)
    (new / "metrics.jsonl").write_text("")
    lock.release(failed_start=True)
    assert (new / "metrics.jsonl").is_file()


def test_rerunning_a_finished_run_says_so_and_writes_nothing(tmp_path, capsys):
    args = tiny_args(tmp_path, "--checkpoint.enable", "true", steps=2)
    Trainer(*configure(args)).run()

    def files() -> dict[Path, tuple[bytes, int]]:
        found = (p for p in tmp_path.rglob("*") if p.name != LOCK_FILE)
        return {p: (p.is_file() and p.read_bytes(), p.stat().st_mtime_ns) for p in found}

    before = files()
    capsys.readouterr()
    assert run_cli(lambda: Trainer(*configure(args)).run()) == 0
    assert files() == before
    said = [line.split(" INFO ", 1)[-1] for line in capsys.readouterr().err.splitlines()]
    done = said.index(
        f"the run in {tmp_path} is already complete at step 2: nothing to do (to train further, "
        "raise training.steps)"
    )
    # Then the summary, as at the end of the run: its checkpoint and what to do with it.
    assert said[done + 1].startswith("run ends at step 2 of 2; ")
    assert said[-1].startswith("next: plugtrain eval ")
