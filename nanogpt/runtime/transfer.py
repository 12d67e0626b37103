"""Copies between the host and the model's device that never make the host wait for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory, which synchronizes the stream:
the host then waits for every kernel queued before it (the whole decode step, when the engine runs
one step ahead). A copy from pinned memory with `non_blocking` is queued on the stream like a kernel.
On a CPU both are plain tensors.
"""
from __future__ import annotations

import torch


def to_device(values, device, dtype=torch.long) -> torch.Tensor:
    """`values` (a list, nested lists, or a host tensor) as a tensor on `device`, queued behind the
    device's work instead of waiting for it."""
    device = torch.device(device)
    if device.type != "cuda":
        return values.to(device, dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype, device=device)
    host = values.to(dtype).pin_memory() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


class ToHost:
    """A device tensor on its way to the host: the copy is queued at once, and `tolist()` waits for
    that copy alone (on a CPU there is nothing to wait for)."""

    def __init__(self, tensor: torch.Tensor):
        self._event = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensor = host
        self._tensor = tensor

    def ready(self) -> bool:
        """Whether the copy has landed (tolist() would not wait)."""
        return self._event is None or self._event.query()

    def tolist(self) -> list:
        if self._event is not None:
            self._event.synchronize()
        return self._tensor.tolist()
