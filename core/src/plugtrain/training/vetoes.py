"""The step's veto: the plugins' ``pre_step`` answers, combined and applied on the device.

A veto a plugin knows on the host is a reason string; one computed from device values (an inf
flag, a norm) is a 0-d bool tensor, which nobody reads: the combined flag goes to the fused
optimizer as its ``found_inf`` (the kernel skips the update, moments and step count included,
as it does for ``torch.amp.GradScaler``) and to the LR schedule as "0 steps applied".
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.optim import Optimizer

from plugtrain.errors import PluginError


class Vetoes:
    """Combines each step's vetoes and counts them, per plugin, without a host read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.total = torch.zeros((), dtype=torch.int64, device=device)
        """Steps skipped so far, on the device."""
        self.by_plugin: dict[str, torch.Tensor] = {}
        """Steps each plugin vetoed since this process started, on the device (a step that
        several plugins vetoed counts for each of them)."""
        self._no = torch.zeros((), dtype=torch.bool, device=device)
        self._yes = torch.ones((), dtype=torch.bool, device=device)

    def combine(self, answers: Mapping[str, object]) -> tuple[torch.Tensor, list[str]]:
        """The step's skip flag (a 0-d bool tensor) and reasons, from ``pre_step``'s answers
        by plugin name; a wrong answer is a :class:`PluginError` naming the plugin."""
        reasons: list[str] = []
        flags: list[torch.Tensor] = []
        for name, answer in answers.items():
            if isinstance(answer, str):
                if answer:
                    reasons.append(answer)
                    self._count(name, self._yes)
            elif isinstance(answer, torch.Tensor):
                if answer.ndim != 0 or answer.dtype != torch.bool:
                    shape = list(answer.shape)
                    raise PluginError(
                        self._wrong(name, f"a {answer.dtype} tensor of shape {shape}")
                    )
                flags.append(answer)
                self._count(name, answer)
            else:
                raise PluginError(self._wrong(name, f"{type(answer).__name__} {answer!r:.40}"))
        if reasons:
            skip = self._yes
        elif flags:
            skip = flags[0] if len(flags) == 1 else torch.stack(flags).any()
        else:
            skip = self._no
        self.total += skip
        return skip, reasons

    def _count(self, name: str, flag: torch.Tensor) -> None:
        count = self.by_plugin.get(name)
        if count is None:
            count = self.by_plugin[name] = torch.zeros((), dtype=torch.int64, device=self.device)
        count += flag

    @staticmethod
    def _wrong(name: str, what: str) -> str:
        return (
            f"plugin '{name}': pre_step returned {what}; return None, a reason string, or a 0-d "
            "bool tensor on the training device (true: skip the step)"
        )

    def apply(self, optimizer: Optimizer, skip: torch.Tensor, reasons: list[str]) -> None:
        """Run ``optimizer.step()`` unless ``skip``, reading nothing from the device.

        A string veto is known on the host: no step at all. A device flag goes to an optimizer
        that supports it (fused AdamW, ``_step_supports_amp_scaling``) as ``found_inf``; any
        other optimizer costs one host read of the flag.
        """
        if reasons:
            return
        if skip is self._no:
            optimizer.step()
        elif getattr(optimizer, "_step_supports_amp_scaling", False):
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.found_inf = skip.float()  # type: ignore[attr-defined]
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf  # type: ignore[attr-defined]
        elif not bool(skip):
            optimizer.step()
