"""FsspecStorage against a real S3 server on 127.0.0.1: marker commits, listing, retention,
clean-up, retries and the one-line refusals; no training run (one server for the module)."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from plugtrain.checkpoint.dcp_io import read_checkpoint
from plugtrain.checkpoint.object_store import MARKER, FsspecStorage, open_storage
from plugtrain.checkpoint.records import chat_template_files, read_chat_template
from plugtrain.checkpoint.saved import locate_checkpoint
from plugtrain.config import JobInfoConfig
from plugtrain.errors import CheckpointError, ConfigError
from plugtrain.testing import SMALL_RUN_CONFIG, SMALL_TEMPLATE, free_port, save_small_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

_prefixes = itertools.count()


@pytest.fixture
def storage(s3_server) -> FsspecStorage:
    """A fresh prefix of the module's server; a failure is tried twice, 10 ms apart."""
    url = s3_server.url(f"run{next(_prefixes)}")
    return FsspecStorage(url, s3_server.endpoint, attempts=2, backoff_s=0.01)


def objects(s3_server, storage: FsspecStorage) -> list[str]:
    fs = s3_server.filesystem()
    return sorted(p[len(storage.root) + 1 :] for p in fs.find(storage.root))


def test_a_marked_checkpoint_is_listed_and_reads_back(s3_server, storage):
    assert storage.steps() == [] and not storage.exists(5)
    state = save_small_checkpoint(storage, 5)
    assert storage.location == f"{storage.url}/checkpoints"
    assert storage.where(5) == f"{storage.url}/checkpoints/step-5"
    assert storage.steps() == [5] and storage.exists(5)
    assert objects(s3_server, storage) == [
        f"step-5/{MARKER}", "step-5/.metadata", "step-5/__0_0.distcp", "step-5/config.json",
    ]  # fmt: skip
    assert storage.read_config(5) == SMALL_RUN_CONFIG
    loaded = read_checkpoint(storage.where(5), reader=storage.reader(5))
    assert torch.equal(loaded["w"], state["w"]) and loaded["train.step"].item() == 5
    assert storage.size(5) == sum(
        s3_server.filesystem().du(f"{storage.root}/step-5", total=False).values()
    )


def test_the_chat_template_staged_with_a_checkpoint_reads_back(s3_server, storage):
    save_small_checkpoint(storage, 1)
    save_small_checkpoint(storage, 2, files=chat_template_files(SMALL_TEMPLATE))
    assert "step-2/chat_template.jinja" in objects(s3_server, storage)
    read = read_chat_template(storage, 2)
    assert read is not None and read.origin == f"{storage.where(2)}/chat_template.jinja"
    assert (read.source, read.special_tokens) == (
        SMALL_TEMPLATE.source,
        SMALL_TEMPLATE.special_tokens,
    )
    # None recorded: said at once (an absent object is no failure to retry; a retry would
    # wait 10 s here).
    patient = FsspecStorage(storage.url, s3_server.endpoint, attempts=2, backoff_s=10.0)
    start = time.perf_counter()
    assert read_chat_template(patient, 1) is None and time.perf_counter() - start < 5


def test_an_unmarked_checkpoint_is_never_listed_and_is_cleaned(s3_server, storage):
    save_small_checkpoint(storage, 2)
    save_small_checkpoint(storage, 4, commit=False)  # shards, .metadata: complete to DCP
    assert "step-4/.metadata" in objects(s3_server, storage)
    assert storage.steps() == [2] and not storage.exists(4)
    storage.clean()
    assert objects(s3_server, storage) == [
        f"step-2/{MARKER}", "step-2/.metadata", "step-2/__0_0.distcp", "step-2/config.json",
    ]  # fmt: skip


def test_staging_again_replaces_what_a_crash_left(s3_server, storage):
    save_small_checkpoint(storage, 3, commit=False)
    s3_server.filesystem().pipe(f"{storage.root}/step-3/left-by-a-crash", b"x")
    storage.stage(3, {"other": 1})
    assert objects(s3_server, storage) == ["step-3/config.json"]
    assert not storage.exists(3)


def test_a_commit_never_replaces_a_complete_checkpoint(storage):
    save_small_checkpoint(storage, 2)
    with pytest.raises(FileExistsError, match="step-2 is already complete"):
        storage.commit(2)
    assert storage.steps() == [2]


def test_retention_deletes_only_marked_checkpoints_oldest_first(s3_server, storage):
    for step in (1, 2, 3):
        save_small_checkpoint(storage, step)
    save_small_checkpoint(storage, 4, commit=False)
    assert storage.prune(keep=2, up_to=3) == [1]
    assert storage.steps() == [2, 3]
    assert {p.split("/")[0] for p in objects(s3_server, storage)} == {"step-2", "step-3"}
    assert storage.prune(keep=0, up_to=3) == []  # 0 keeps every one


def test_a_delete_unlists_before_it_removes(s3_server, storage):
    save_small_checkpoint(storage, 1)
    fs = s3_server.filesystem()
    fs.rm_file(f"{storage.root}/step-1/{MARKER}")  # a crash after unlisting, before removing
    assert storage.steps() == []
    storage.clean()
    assert objects(s3_server, storage) == []
    save_small_checkpoint(storage, 2)
    storage.delete(2)
    assert storage.steps() == [] and objects(s3_server, storage) == []


def test_read_file_gives_a_checkpoints_object_and_locate_reads_through_it(s3_server, storage):
    save_small_checkpoint(storage, 3)
    save_small_checkpoint(storage, 5, run_config={**SMALL_RUN_CONFIG, "seed": 5})
    save_small_checkpoint(storage, 7, commit=False)
    stored = s3_server.filesystem().cat_file(f"{storage.root}/step-5/config.json")
    assert storage.read_file(5, "config.json") == stored and json.loads(stored)["seed"] == 5
    # An absent object is said at once, not retried.
    with pytest.raises(
        FileNotFoundError, match=r"download of .*step-5/nothing.json failed: no such"
    ):
        storage.read_file(5, "nothing.json")
    # The run's URL, its checkpoints prefix and a step-N prefix, as the local disk's paths.
    for url, step in ((storage.url, 5), (storage.location, 5), (storage.where(3), 3)):
        found = locate_checkpoint(url, s3_server.endpoint)
        assert (found.step, found.location) == (step, storage.where(step))
        assert found.read_file("config.json") == storage.read_file(step, "config.json")
    with pytest.raises(CheckpointError, match=r"step-7' is no complete checkpoint \(missing"):
        locate_checkpoint(storage.where(7), s3_server.endpoint)


def test_a_save_to_a_stopped_store_fails_after_its_retries_and_keeps_the_last(s3_server, storage):
    save_small_checkpoint(storage, 1)
    storage.stage(2, SMALL_RUN_CONFIG)
    s3_server.stop()
    try:
        with pytest.raises(dcp.CheckpointException, match="failed 2 times"):
            dcp.save({"w": torch.ones(3)}, storage_writer=storage.writer(2), no_dist=True)
        storage.discard(2)  # never raises, even with the store away
    finally:
        s3_server.start()
    assert storage.steps() == [1]


def test_an_unreachable_store_is_refused_in_one_line(s3_server):
    url = s3_server.url("nowhere")
    storage = open_storage(url, f"http://127.0.0.1:{free_port()}", retries=0)
    with pytest.raises(CheckpointError) as e:
        storage.check()
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"cannot reach the checkpoint store {url}/")
    assert "checkpoint.endpoint_url" in message and s3_server.secret not in message
    open_storage(url, s3_server.endpoint).check()  # the same URL, reachable


def test_the_endpoint_is_read_from_the_environment_each_time_a_store_is_opened(
    s3_server, monkeypatch
):
    # The same URL opened with the environment's endpoint (no checkpoint.endpoint_url), then
    # after AWS_ENDPOINT_URL moved to a dead port: the second store must not reach the first.
    url = s3_server.url("moved")
    open_storage(url, retries=0).check()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(CheckpointError, match="cannot reach the checkpoint store"):
        open_storage(url, retries=0).check()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"dump_folder": "s3://b/run"}, "job.dump_folder s3://b/run is a URL, which holds the "
         "checkpoints only: set job.local_folder"),
        ({"dump_folder": "s3://AKIA:secret@b/run", "local_folder": "x"}, "holds credentials"),
        ({"dump_folder": "s3:///run", "local_folder": "x"}, "names no bucket"),
        ({"dump_folder": "s3://my bucket/run", "local_folder": "x"}, "^job.dump_folder "
         "s3://my bucket/run names bucket 'my bucket', which is no S3 bucket name: use 3 to 63 "
         "lowercase letters, digits, dots and hyphens$"),
        ({"local_folder": "s3://b/x"}, "must be a local folder, not a URL"),
    ],
)  # fmt: skip
def test_a_bad_url_is_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message) as e:
        JobInfoConfig(**fields)
    assert "secret" not in str(e.value)


def test_a_bucket_name_botocore_sends_is_not_refused():
    # Legacy buckets may hold capitals and underscores: only what no request could name fails.
    JobInfoConfig(dump_folder="s3://Legacy_Bucket.1/run", local_folder="x")


def test_the_local_folder_holds_the_records():
    assert JobInfoConfig(dump_folder="s3://b/run", local_folder="out").records_folder == "out"
    assert JobInfoConfig(dump_folder="out/run").records_folder == "out/run"
