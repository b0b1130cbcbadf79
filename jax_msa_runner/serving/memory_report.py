"""The start-up memory report: weights by dtype, the KV cache, and how many KV pages fit.

Counted per device from the arrays' addressable shards (under TP/EP/DCP each device holds its
own shard); the busiest device is reported. ``pages_that_fit`` needs the device's memory
limit (``Device.memory_stats()["bytes_limit"]``, GPU only): (limit - weights - the largest
step's XLA temp) // bytes of one page on that device.
"""
from __future__ import annotations

import dataclasses

from jax_msa_runner.attention.parallel import bytes_by_device

MiB = 2 ** 20


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes on the device holding the most weights.

    weights_by_dtype: {dtype name: bytes}, largest first; cache_bytes: its KV and index-K
    caches (``num_pages`` pages); page_bytes: one page of every layer's caches;
    step_temp_bytes / device_limit_bytes: None where unknown (CPU).
    """

    num_devices: int
    weights_by_dtype: dict
    cache_bytes: int
    num_pages: int
    step_temp_bytes: int | None
    device_limit_bytes: int | None

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights_by_dtype.values())

    @property
    def page_bytes(self) -> int:
        return self.cache_bytes // max(self.num_pages, 1)

    @property
    def pages_that_fit(self) -> int | None:
        if self.device_limit_bytes is None or not self.page_bytes:
            return None
        free = self.device_limit_bytes - self.weight_bytes - (self.step_temp_bytes or 0)
        return max(free, 0) // self.page_bytes

    def lines(self) -> list[str]:
        """Two lines for the start-up log."""
        per = " per device" if self.num_devices > 1 else ""
        dtypes = ", ".join(f"{name} {b / MiB:.1f}" for name, b in self.weights_by_dtype.items())
        fit = self.pages_that_fit
        room = (f"{fit} pages fit in the device's {self.device_limit_bytes / 2**30:.1f} GiB "
                f"after weights and step temp {(self.step_temp_bytes or 0) / MiB:.1f} MiB"
                if fit is not None else "device memory limit unknown on this backend")
        return [f"memory{per}: weights {self.weight_bytes / MiB:.1f} MiB ({dtypes} MiB)",
                f"memory{per}: KV cache {self.num_pages} pages x {self.page_bytes / MiB:.3f} MiB "
                f"= {self.cache_bytes / MiB:.1f} MiB; {room}"]


def memory_report(params, caches, num_pages: int, *, step_temp_bytes: int | None = None,
                  device_limit_bytes: int | None = None) -> MemoryReport:
    """The report of ``params`` and ``caches`` (pytrees of placed arrays; caches of
    ``num_pages`` pages per device)."""
    weights = bytes_by_device(params)
    device = max(weights, key=lambda d: sum(weights[d].values()))
    cache = bytes_by_device(caches).get(device, {})
    return MemoryReport(
        num_devices=len(weights),
        weights_by_dtype=dict(sorted(weights[device].items(), key=lambda kv: -kv[1])),
        cache_bytes=sum(cache.values()), num_pages=num_pages,
        step_temp_bytes=step_temp_bytes, device_limit_bytes=device_limit_bytes)


__all__ = ["MemoryReport", "memory_report"]
