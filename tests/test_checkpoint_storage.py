"""LocalStorage alone: staging, atomic commits, listing, retention, deletion and its errors."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from plugtrain.checkpoint.dcp_io import read_metadata
from plugtrain.checkpoint.records import chat_template_files, read_chat_template
from plugtrain.checkpoint.saved import locate_checkpoint
from plugtrain.checkpoint.storage import DELETING, PARTIAL, LocalStorage
from plugtrain.errors import CheckpointError
from plugtrain.testing import SMALL_RUN_CONFIG, SMALL_TEMPLATE, save_small_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def storage(tmp_path) -> LocalStorage:
    return LocalStorage(tmp_path / "checkpoints")


def test_a_missing_folder_holds_nothing(storage):
    assert storage.steps() == []
    assert not storage.exists(1)
    storage.clean()  # nothing to clean, and nothing created
    assert not storage.location.exists()
    assert storage.where(3) == storage.location / "step-3"


def test_a_committed_checkpoint_is_listed_and_reads_back(storage):
    state = save_small_checkpoint(storage, 5)
    assert storage.steps() == [5] and storage.exists(5)
    assert sorted(p.name for p in storage.location.iterdir()) == ["step-5"]
    assert storage.read_config(5) == SMALL_RUN_CONFIG
    loaded = {"w": torch.zeros(3), "train": {"step": torch.tensor(0)}}
    dcp.load(loaded, storage_reader=storage.reader(5), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["train"]["step"].item() == 5
    files = [p for p in storage.where(5).iterdir() if p.is_file()]
    assert storage.size(5) == sum(p.stat().st_size for p in files) > 0


def test_the_chat_template_staged_with_a_checkpoint_reads_back(storage):
    save_small_checkpoint(storage, 1)
    save_small_checkpoint(storage, 2, files=chat_template_files(SMALL_TEMPLATE))
    assert read_chat_template(storage, 1) is None  # a text run's, or an older run's
    read = read_chat_template(storage, 2)
    assert read is not None and read.origin == f"{storage.where(2)}/chat_template.jinja"
    assert (read.source, read.special_tokens) == (
        SMALL_TEMPLATE.source,
        SMALL_TEMPLATE.special_tokens,
    )
    assert (storage.where(2) / "chat_template.jinja").read_text() == SMALL_TEMPLATE.source


def test_a_staged_checkpoint_is_never_listed_until_committed(storage):
    save_small_checkpoint(storage, 2)
    save_small_checkpoint(storage, 4, commit=False)  # shards, .metadata: complete to DCP
    assert (storage.location / f"step-4{PARTIAL}" / ".metadata").is_file()
    assert storage.steps() == [2] and not storage.exists(4)
    storage.commit(4)
    assert storage.steps() == [2, 4]
    assert not (storage.location / f"step-4{PARTIAL}").exists()


def test_staging_again_replaces_what_a_crash_left(storage):
    save_small_checkpoint(storage, 3, commit=False)
    staged = storage.location / f"step-3{PARTIAL}"
    (staged / "left-by-a-crash").touch()
    storage.stage(3, {"other": 1})
    assert sorted(p.name for p in staged.iterdir()) == ["config.json"]
    assert json.loads((staged / "config.json").read_text()) == {"other": 1}


def test_a_commit_never_replaces_a_complete_checkpoint(storage):
    save_small_checkpoint(storage, 2)
    (storage.where(2) / "mark").touch()
    save_small_checkpoint(storage, 2, commit=False)
    with pytest.raises(FileExistsError):
        storage.commit(2)
    assert (storage.where(2) / "mark").is_file()
    assert (storage.location / f"step-2{PARTIAL}").is_dir()  # for discard or clean


def test_committing_what_was_never_staged_is_an_error(storage):
    storage.location.mkdir()
    with pytest.raises(FileNotFoundError):
        storage.commit(7)
    assert storage.steps() == []


def test_discard_removes_the_staged_checkpoint_only_and_never_raises(storage):
    save_small_checkpoint(storage, 2)
    save_small_checkpoint(storage, 4, commit=False)
    storage.discard(4)
    storage.discard(4)  # nothing left: still fine
    storage.discard(9)
    assert sorted(p.name for p in storage.location.iterdir()) == ["step-2"]


def test_listing_is_by_step_and_ignores_everything_else(storage):
    for step in (10, 2, 100):
        save_small_checkpoint(storage, step)
    for name in (f"step-5{PARTIAL}", f"step-6{DELETING}", "step-x", "other"):
        (storage.location / name).mkdir()
    (storage.location / "step-7").write_text("a file, not a checkpoint")
    assert storage.steps() == [2, 10, 100]  # numerically, oldest first
    assert storage.exists(7)  # its name is taken all the same


def test_delete_unlists_first_and_finishes_a_crashed_deletion(storage):
    for step in (1, 2):
        save_small_checkpoint(storage, step)
    shutil.copytree(storage.where(1), storage.location / f"step-1{DELETING}")  # a crash's
    storage.delete(1)
    assert sorted(p.name for p in storage.location.iterdir()) == ["step-2"]
    with pytest.raises(FileNotFoundError):
        storage.delete(1)


def test_clean_removes_what_crashes_left(storage):
    save_small_checkpoint(storage, 2)
    save_small_checkpoint(storage, 4, commit=False)
    (storage.location / f"step-1{DELETING}").mkdir()
    (storage.location / "notes.txt").write_text("kept")
    storage.clean()
    assert sorted(p.name for p in storage.location.iterdir()) == ["notes.txt", "step-2"]


@pytest.mark.parametrize(
    ("keep", "up_to", "deleted", "left"),
    [
        (2, 4, [1, 2], [3, 4, 6]),  # step-6 is later than the save: never pruned here
        (1, 6, [1, 2, 3, 4], [6]),
        (0, 6, [], [1, 2, 3, 4, 6]),  # 0 keeps all
        (9, 6, [], [1, 2, 3, 4, 6]),
    ],
)
def test_prune_keeps_the_newest_k_up_to_the_step(storage, keep, up_to, deleted, left):
    for step in (1, 2, 3, 4, 6):
        save_small_checkpoint(storage, step)
    save_small_checkpoint(storage, 5, commit=False)  # a crash's leftover: always cleaned
    assert storage.prune(keep, up_to) == deleted
    assert storage.steps() == left
    assert sorted(p.name for p in storage.location.iterdir()) == [f"step-{s}" for s in left]


def test_free_bytes_of_a_folder_not_created_yet(storage, tmp_path):
    free = storage.free_bytes()  # of tmp_path, the nearest folder that exists
    assert free is not None and abs(free - shutil.disk_usage(tmp_path).free) < 2**26


def test_the_reader_never_unpickles_an_object(storage):
    save_small_checkpoint(storage, 3)
    (storage.where(3) / ".metadata").write_bytes(pickle.dumps(print))
    with pytest.raises(CheckpointError) as info:
        read_metadata(storage.where(3), storage.reader(3))
    assert str(info.value) == (
        f"checkpoint {storage.where(3)} is damaged: cannot read its .metadata (UnpicklingError: "
        "refusing to load 'builtins.print' from .metadata); delete it to resume from the one "
        "before, or pick one with --checkpoint.load_step"
    )
    (storage.where(3) / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"is damaged: it has no \.metadata; delete it"):
        read_metadata(storage.where(3), storage.reader(3))


def test_a_config_that_cannot_be_read_is_an_os_or_value_error(storage):
    save_small_checkpoint(storage, 3)
    config = storage.where(3) / "config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError):
        storage.read_config(3)
    config.unlink()
    with pytest.raises(OSError):
        storage.read_config(3)


def test_staging_under_a_file_is_an_os_error(tmp_path):
    (tmp_path / "file").write_text("")
    storage = LocalStorage(Path(tmp_path / "file" / "checkpoints"))
    with pytest.raises(OSError):
        storage.stage(1, SMALL_RUN_CONFIG)
    assert storage.steps() == []


def test_read_file_gives_a_checkpoints_bytes_and_locate_reads_through_it(storage, tmp_path):
    save_small_checkpoint(storage, 3)
    save_small_checkpoint(storage, 5, run_config={**SMALL_RUN_CONFIG, "seed": 5})
    on_disk = (storage.where(5) / "config.json").read_bytes()
    assert storage.read_file(5, "config.json") == on_disk
    assert json.loads(on_disk)["seed"] == 5
    with pytest.raises(FileNotFoundError):
        storage.read_file(5, "nothing.json")
    # A dump folder, its checkpoints folder and a step-N folder all name a checkpoint of it.
    for path, step in ((tmp_path, 5), (storage.location, 5), (storage.where(3), 3)):
        found = locate_checkpoint(path)
        assert (found.step, found.location) == (step, storage.where(step))
        assert found.read_file("config.json") == storage.read_file(step, "config.json")
    with pytest.raises(CheckpointError, match=r"'.*step-4' is no complete checkpoint \(missing"):
        locate_checkpoint(storage.location / "step-4")
    with pytest.raises(CheckpointError, match=r"no checkpoint at '.*nowhere': give a run's dump"):
        locate_checkpoint(tmp_path / "nowhere")
