"""Skipped batch ranges: the loader wrapper, its checkpoint state, and the skip file."""

from __future__ import annotations

import pytest

from plugtrain.data.skips import SKIP_FILE, SkippingLoader, read_skip_file, write_skip_file
from plugtrain.distributed import ParallelDims
from plugtrain.errors import CheckpointError, DataError
from plugtrain.plugin import Rewind, RunControl, SkipRange
from plugtrain.training.requests import RunRequests


class Counting:
    """A loader whose batches are their own numbers."""

    def __init__(self) -> None:
        self.n = 0

    def next_batch(self) -> int:
        self.n += 1
        return self.n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.n = state_dict["n"]


def test_ranges_are_skipped_and_kept_in_the_state():
    loader = SkippingLoader(Counting(), [SkipRange(2, 3, "a")])
    assert [loader.next_batch() for _ in range(2)] == [1, 4]
    state = loader.state_dict()
    assert state["n"] == state["batches_drawn"] == 4
    # Loading an older state (a rewind) keeps the ranges known since, and adds its own.
    older = SkippingLoader(Counting(), [SkipRange(6, 6, "b")])
    older.load_state_dict(state)
    assert [(r.first, r.last, r.source) for r in older.ranges] == [(6, 6, "b"), (2, 3, "")]
    assert [older.next_batch() for _ in range(2)] == [5, 7]


def test_the_skip_file_round_trips_and_a_damaged_one_is_one_line(tmp_path):
    assert read_skip_file(tmp_path) == ([], None)
    ranges = [SkipRange(5, 8, "spike_guard", "spike")]
    rewind = Rewind(7, 5, 8, "spike_guard", "spike")
    write_skip_file(tmp_path, ranges, rewind)
    assert read_skip_file(tmp_path) == (ranges, rewind)
    (tmp_path / SKIP_FILE).write_text("{")
    with pytest.raises(DataError, match=f"{SKIP_FILE} is damaged .*delete it") as e:
        read_skip_file(tmp_path)
    assert "\n" not in str(e.value)


class NoCheckpoint:
    def wait(self) -> None:
        pass

    def latest_at_most(self, at_most: int) -> int:
        raise CheckpointError(f"cannot rewind to step {at_most} or earlier")


def test_a_rewind_with_no_checkpoint_to_go_to_is_refused_before_it_is_recorded(tmp_path):
    control = RunControl()
    world = ParallelDims()
    requests = RunRequests(
        control, SkippingLoader(Counting(), control.skip_ranges), NoCheckpoint(), tmp_path, world
    )
    control.rewind(7, 0, 8, "guard", "spike")
    with pytest.raises(CheckpointError, match="cannot rewind to step 0"):
        requests.after_step()
    assert not (tmp_path / SKIP_FILE).exists()  # a restart does not retry it


class Killed(Exception):
    """A SIGKILL of the process, simulated."""


class SaveInFlight:
    """Checkpoints ``complete``, and an async save of ``in_flight`` that ``wait`` commits and a
    kill loses; ``rewind`` is killed as it begins when ``kill`` is set."""

    def __init__(self, complete: set[int], in_flight: int | None, kill: bool) -> None:
        self.complete, self.in_flight, self.kill = complete, in_flight, kill

    def wait(self) -> None:
        if self.in_flight is not None:
            self.complete.add(self.in_flight)
            self.in_flight = None

    def latest_at_most(self, at_most: int) -> int:
        return max(s for s in self.complete if s <= at_most)

    def rewind(self, at_most: int) -> int:
        if self.kill:
            raise Killed
        self.wait()
        return self.latest_at_most(at_most)


def test_a_kill_during_a_rewind_restarts_to_the_checkpoint_saved_in_flight(tmp_path):
    # A rewind asked while step-16's async save uploads goes to step-16; killed as it begins
    # (before a restart can see that save), the restart must go there too, not to step-12.
    world = ParallelDims()
    control = RunControl()
    killed = SaveInFlight({12}, in_flight=16, kill=True)
    batches = SkippingLoader(Counting(), control.skip_ranges)
    requests = RunRequests(control, batches, killed, tmp_path, world)
    control.rewind(19, 17, 23, "guard", "spike")
    with pytest.raises(Killed):
        requests.after_step()
    assert read_skip_file(tmp_path)[1] == Rewind(19, 17, 23, "guard", "spike")
    restarted = RunControl()
    checkpoints = SaveInFlight(set(killed.complete), in_flight=None, kill=False)
    batches = SkippingLoader(Counting(), restarted.skip_ranges)
    RunRequests(restarted, batches, checkpoints, tmp_path, world).resume()
    assert [r.loaded_step for r in restarted.rewinds] == [16]
