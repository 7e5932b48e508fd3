"""The next batch's copy to the GPU is queued while the device still computes the step.

:class:`~plugtrain.data.prefetch.DevicePrefetcher` draws the next batch and copies it from
pinned memory with ``non_blocking=True`` right after the step is launched. The copy goes on the
step's own stream, so stream order is what orders it after the step and before the next one:
no event is needed. Checked with CUDA events (the step's end has not been reached on the device
when the host has already queued the next batch), with the profiler (the copies are from pinned
memory: a pageable copy would block the host) and against the loader (the batch is the right
one, whole).
"""

from __future__ import annotations

import warnings

import torch
from torch.autograd import DeviceType

from plugtrain.testing import make_trainer

BUSY_CYCLES = 200_000_000
"""GPU clock cycles (~0.1 s) of a kernel that stands for a long step, so that the device is
surely still busy when the host queues the next batch."""


def test_the_next_batch_is_copied_behind_the_step_without_waiting(tmp_path, device, device_args):
    trainer = make_trainer(tmp_path, *device_args, steps=4)
    prefetcher = trainer.batches  # the skipping loader over the DevicePrefetcher
    loader = prefetcher.inner.loader
    trainer.train_step(prefetcher.next_batch())
    prefetcher.prefetch()  # the first step and copy: lazy initialisation out of the way
    trainer.train_step(prefetcher.next_batch())
    drawn_from = loader.state_dict()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda._sleep(BUSY_CYCLES)
        step_done = torch.cuda.Event()
        step_done.record()
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            prefetcher.prefetch()
            host_ahead = not step_done.query()
            torch.cuda.synchronize()
        # The host drew, pinned and queued the next batch while the device was on the step.
        assert host_ahead
        on_device = [e.name for e in profile.events() if e.device_type == DeviceType.CUDA]
        if on_device:
            copies = [name for name in on_device if "Memcpy" in name]
            assert any("HtoD" in name for name in copies), on_device
            assert not any("Pageable" in name for name in copies), copies
        else:  # NOTE: without CUPTI the profiler records no device activity at all
            unchecked = "the profiler saw no CUDA activity: the copies' kind is unchecked"
            warnings.warn(unchecked, stacklevel=1)
    else:
        prefetcher.prefetch()
    batch = prefetcher.next_batch()
    after = loader.state_dict()
    loader.load_state_dict(drawn_from)
    expected = loader.next_batch()
    loader.load_state_dict(after)
    assert len(batch) == len(expected) > 0
    for got, want in zip(batch, expected, strict=True):
        (inputs, targets, *_), (want_inputs, want_targets, *_) = got, want
        assert inputs.device.type == targets.device.type == device.type
        assert torch.equal(inputs.cpu(), want_inputs) and torch.equal(targets.cpu(), want_targets)
    trainer.train_step(batch)  # the step after the copy uses it (stream order)
    trainer.close()
