"""Counting what code costs the device: host syncs and collectives.

A :class:`CostCounter` counts, while it is active, two things a training step should avoid or
ration:

* **host syncs**: reads of tensor values by the host (``Tensor.item``, ``tolist``, ``bool(t)``,
  ``float(t)``, ``torch.equal``, ``nonzero``, copies to the CPU, ``torch.cuda.synchronize``...).
  On CUDA each one makes the host wait for the device. On a CPU run nothing waits, but every
  tensor lives on the CPU, so the counter counts every read of a (non-meta) tensor: it is the
  read that becomes a sync on CUDA. Reads that are host-side by design (a CPU control tensor)
  can be left out with :meth:`CostCounter.ignore`.
* **collectives**: ``torch.distributed`` operations, by op name (``c10d.allreduce_``,
  ``_c10d_functional.all_gather_into_tensor``), including those DTensor issues inside its ops
  and those FSDP2 issues in forward and backward.

How: a ``TorchFunctionMode`` sees the Python-level reads (``tolist`` and ``numpy`` run no aten
op, so only it can), a ``TorchDispatchMode`` sees the collectives and the ``aten``-level reads
(``_local_scalar_dense``) of code the function mode does not see, and ``torch.cuda.synchronize``,
``torch.accelerator.synchronize`` and ``Stream``/``Event.synchronize`` are patched. Where CUDA is
initialised, ``torch.cuda.set_sync_debug_mode("warn")`` is on too, and each of its warnings not
already counted above counts as ``"cuda sync"`` (this CUDA path is untested in the suite, which
runs on CPU). Nothing is installed while no counter is active, so code that counts nothing pays
nothing.

What is seen where: the function mode is off inside autograd's hooks (torch drops it there; the
dispatch mode stays), so in backward (FSDP2's hooks, gradient hooks) a read counts as
``"aten._local_scalar_dense"`` when it runs an aten op (``item``, ``bool``, ``float``, ``int``)
and is missed when it does not (``tolist``, ``numpy`` of a CPU tensor). The same holds inside a
torch function the function mode intercepts (it is off while the function runs). Also missed:
threads other than the one that entered the counter, except autograd's device threads, which
inherit torch's dispatch modes; C++ reads that neither run an aten op nor trigger CUDA's sync
warning; ``synchronize`` functions imported by name before the counter started.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

__all__ = ["CostCounter"]

_T = torch.Tensor
# Functions whose result is a Python value (or an array sharing host memory) read from a
# tensor's data, or whose output size depends on the data: each waits for the device.
_READS: dict[Callable[..., Any], str] = {
    _T.item: "Tensor.item",
    _T.tolist: "Tensor.tolist",
    _T.numpy: "Tensor.numpy",
    _T.__array__: "Tensor.__array__",
    _T.__bool__: "Tensor.__bool__",
    _T.__float__: "Tensor.__float__",
    _T.__int__: "Tensor.__int__",
    _T.__index__: "Tensor.__index__",
    _T.__complex__: "Tensor.__complex__",
    _T.__format__: "Tensor.__format__",
    _T.__repr__: "Tensor.__repr__",
    _T.__contains__: "Tensor.__contains__",
    _T.is_nonzero: "Tensor.is_nonzero",
    torch.is_nonzero: "torch.is_nonzero",
    _T.equal: "Tensor.equal",
    torch.equal: "torch.equal",
    _T.allclose: "Tensor.allclose",
    torch.allclose: "torch.allclose",
    _T.nonzero: "Tensor.nonzero",
    torch.nonzero: "torch.nonzero",
    _T.argwhere: "Tensor.argwhere",
    torch.argwhere: "torch.argwhere",
    _T.masked_select: "Tensor.masked_select",
    torch.masked_select: "torch.masked_select",
}
_COPIES = (_T.cpu, _T.to, _T.copy_)
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
# Ops of those namespaces that move no data between ranks.
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})
_CUDA_SYNC_WARNING = "synchronizing CUDA operation"
# Frames skipped when naming where a sync came from: this module and torch's dispatch plumbing.
_PLUMBING = ("plugtrain.observability.costs", "torch.overrides", "torch._tensor", "torch._ops")


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.counters: list[CostCounter] = []
        self.modes: tuple[_HostReads, _Collectives] | None = None
        self.ignoring = 0
        self.attributed = 0
        """Inside a read already counted: the aten op or CUDA warning it causes is not new."""


_state = _ThreadState()


def _site() -> str:
    """The innermost frame outside the counting machinery, as ``module:line (function)``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PLUMBING):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_lineno} ({frame.f_code.co_name})"


def _count_sync(counters: list[CostCounter], cause: str) -> None:
    if _state.ignoring or not counters:
        return
    where = f"{cause} at {_site()}"
    for counter in counters:
        counter.syncs[cause] += 1
        counter.sync_sites[where] += 1


@contextmanager
def _attributed() -> Iterator[None]:
    _state.attributed += 1
    try:
        yield
    finally:
        _state.attributed -= 1


def _reads_data(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type != "meta"


def _on_device(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type not in ("cpu", "meta")


def _to_host(func: Callable[..., Any], args: tuple, kwargs: dict) -> str | None:
    """The cause name when ``func(*args, **kwargs)`` is a blocking copy of a device tensor to
    the CPU, else None."""
    if func is _T.copy_:
        dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        to_cpu = isinstance(dst, torch.Tensor) and dst.device.type == "cpu" and _on_device(src)
        return "Tensor.copy_(to cpu)" if to_cpu and not non_blocking else None
    if not _on_device(args[0]):
        return None
    if func is _T.cpu:
        return "Tensor.cpu"
    device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    if device is not None and device.type == "cpu" and not non_blocking:
        return "Tensor.to(cpu)"
    return None


class _HostReads(TorchFunctionMode):
    """Counts the Python-level host reads."""

    def __init__(self, counters: list[CostCounter]) -> None:
        super().__init__()
        self.counters = counters

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        cause = _READS.get(func)
        if cause is None and func in _COPIES:
            cause = _to_host(func, args, kwargs)
        if cause is not None and args and _reads_data(args[0]):
            _count_sync(self.counters, cause)
            with _attributed():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _Collectives(TorchDispatchMode):
    """Counts collectives, and the aten-level reads the function mode did not see."""

    def __init__(self, counters: list[CostCounter]) -> None:
        super().__init__()
        self.counters = counters

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run the op with this mode still on, so that the collectives it issues
            # and the local ops it runs are seen (when the mode calls the op, it is off).
            return NotImplemented
        namespace = func.namespace
        if namespace in _COLLECTIVE_NAMESPACES and func._opname not in _NOT_COLLECTIVES:
            for counter in self.counters:
                counter.collectives[f"{namespace}.{func._opname}"] += 1
        elif func is torch.ops.aten._local_scalar_dense.default and not _state.attributed:
            if _reads_data(args[0]):
                _count_sync(self.counters, "aten._local_scalar_dense")
            with _attributed():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class _ProcessHooks:
    """The process-wide part, shared by every thread's counters: patched ``synchronize``
    functions and CUDA's sync debug mode, installed while any thread counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self.undo: list[Callable[[], None]] = []

    def acquire(self) -> None:
        with self.lock:
            self.users += 1
            if self.users == 1:
                self._install()

    def release(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0:
                while self.undo:
                    self.undo.pop()()

    def _install(self) -> None:
        targets: list[tuple[Any, str, str]] = [
            (torch.cuda, "synchronize", "torch.cuda.synchronize"),
            (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
            (torch.cuda.Event, "synchronize", "Event.synchronize"),
        ]
        if hasattr(torch, "accelerator") and hasattr(torch.accelerator, "synchronize"):
            targets.append((torch.accelerator, "synchronize", "torch.accelerator.synchronize"))
        for owner, name, cause in targets:
            self._patch(owner, name, cause)
        if torch.cuda.is_initialized():
            self._watch_cuda_syncs()

    def _patch(self, owner: Any, name: str, cause: str) -> None:
        original = owner.__dict__[name]

        def synchronize(*args: Any, **kwargs: Any) -> Any:
            _count_sync(_state.counters, cause)
            with _attributed():
                return original(*args, **kwargs)

        setattr(owner, name, synchronize)
        self.undo.append(lambda: setattr(owner, name, original))

    def _watch_cuda_syncs(self) -> None:
        previous_mode = torch.cuda.get_sync_debug_mode()
        catcher = warnings.catch_warnings()
        catcher.__enter__()
        # Each sync warns, not only the first one from a given line.
        warnings.filterwarnings("always", message=f".*{_CUDA_SYNC_WARNING}")
        show = warnings.showwarning

        def showwarning(message: Any, *args: Any, **kwargs: Any) -> None:
            if _CUDA_SYNC_WARNING not in str(message):
                show(message, *args, **kwargs)
            elif not _state.attributed:
                _count_sync(_state.counters, "cuda sync")

        warnings.showwarning = showwarning
        torch.cuda.set_sync_debug_mode("warn")

        def restore() -> None:
            torch.cuda.set_sync_debug_mode(previous_mode)
            catcher.__exit__(None, None, None)

        self.undo.append(restore)


_process_hooks = _ProcessHooks()


class CostCounter:
    """Counts the host syncs and collectives of the code run while it is active.

    Use it as a context manager; its counts grow over every time it is entered. Counters nest:
    code run under an inner counter counts in every active counter of the thread, and entering
    a counter that is already active changes nothing (it is not counted twice).
    """

    def __init__(self) -> None:
        self.syncs: Counter[str] = Counter()
        """Host syncs by cause: ``"Tensor.item"``, ``"Tensor.__bool__"``,
        ``"torch.cuda.synchronize"``, ``"aten._local_scalar_dense"`` (a read by code the
        function-level counting does not see, such as C++), ``"cuda sync"``..."""
        self.sync_sites: Counter[str] = Counter()
        """Host syncs by cause and where they happened: ``"Tensor.item at module:line (fn)"``."""
        self.collectives: Counter[str] = Counter()
        """Collectives by op name: ``"c10d.allreduce_"``, ``"_c10d_functional.all_reduce"``."""
        self._depth = 0

    @property
    def num_syncs(self) -> int:
        """Host syncs counted."""
        return sum(self.syncs.values())

    @property
    def num_collectives(self) -> int:
        """Collectives counted."""
        return sum(self.collectives.values())

    def __enter__(self) -> CostCounter:
        self._depth += 1
        if self._depth > 1:
            return self
        counters = _state.counters
        if not counters:
            _process_hooks.acquire()
            modes = (_HostReads(counters), _Collectives(counters))
            for mode in modes:
                mode.__enter__()
            _state.modes = modes
        counters.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        counters = _state.counters
        counters.remove(self)
        if counters:
            return
        host_reads, collectives = _state.modes or (None, None)
        _state.modes = None
        _process_hooks.release()
        if _get_current_dispatch_mode() is not collectives:
            raise RuntimeError("a CostCounter must exit after the torch modes entered inside it")
        for mode in (collectives, host_reads):
            mode.__exit__(None, None, None)

    @staticmethod
    @contextmanager
    def ignore() -> Iterator[None]:
        """Leave out the host reads of this block, in this thread (collectives still count):
        for reads that are host-side by design, such as a CPU-only control tensor."""
        _state.ignoring += 1
        try:
            yield
        finally:
            _state.ignoring -= 1

    def __repr__(self) -> str:
        return f"CostCounter(syncs={dict(self.syncs)}, collectives={dict(self.collectives)})"
