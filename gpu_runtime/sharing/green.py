"""Spatial SM partitioning with CUDA green contexts (driver API through ``cuda-bindings``).

For every decode size ``k * 8`` in the partition table the device's SM resource is split once
(``cuDevSmResourceSplitByCount``) into a decode group and the remaining SMs; each side gets a
green context (``cuDevResourceGenerateDesc`` → ``cuGreenCtxCreate``) and a non-blocking stream in
it (``cuGreenCtxStreamCreate``), wrapped for PyTorch with ``torch.cuda.get_stream_from_external``.
Kernels launched by PyTorch on such a stream run only on that context's SMs, while memory, modules
and the caching allocator stay those of the primary context. Switching split is choosing another
pre-made pair of streams: no driver call on the hot path.

Why not ``torch.cuda.GreenContext``: it creates one green context from the *first* ``num_sms`` SMs
(the remainder is discarded) and is used by pushing it as the current context, so two of them
(decode 48, finetune 84) would overlap on SMs 0..47, and switching costs a context push/pop with
stream synchronisation. Two disjoint groups from one split need the driver API.

``cuda.bindings`` exists only where a CUDA 12.4+ driver stack is installed; it is imported lazily.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from gpu_runtime.sharing.base import GpuSharing
from gpu_runtime.sharing.partition import PartitionTable

MIN_DRIVER_VERSION = 12050
"""cuGreenCtxStreamCreate appeared in CUDA 12.5."""


class GreenContextError(RuntimeError):
    """A driver call for green contexts failed, or green contexts are unavailable."""


def sm_granularity(major: int) -> int:
    """Minimum SM group size (and multiple) for ``cuDevSmResourceSplitByCount`` by arch major."""
    if major >= 9:
        return 8
    if major == 8:
        return 4
    return 2


def load_driver() -> Any:
    """Import ``cuda.bindings.driver`` (GreenContextError with the reason when absent)."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise GreenContextError(f"cuda-bindings is not installed: {exc}") from exc
    return driver


def _check(driver: Any, call: str, result: Any) -> Any:
    """Unwrap a cuda-bindings ``(CUresult, *values)`` tuple, raising on error."""
    status: Any = result[0] if isinstance(result, tuple) else result
    if int(getattr(status, "value", status)) != 0:
        _, name = driver.cuGetErrorName(status)
        raise GreenContextError(f"{call} failed: {name.decode() if name else status}")
    if not isinstance(result, tuple) or len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def green_context_unavailable_reason(device: torch.device) -> str | None:
    """None if green contexts can be created on ``device``, else why not (for logs/fallback)."""
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        driver = load_driver()
    except GreenContextError as exc:
        return str(exc)
    try:
        _check(driver, "cuInit", driver.cuInit(0))
        version = _check(driver, "cuDriverGetVersion", driver.cuDriverGetVersion())
    except GreenContextError as exc:
        return str(exc)
    if int(version) < MIN_DRIVER_VERSION:
        return f"driver CUDA version {version} < {MIN_DRIVER_VERSION} (no cuGreenCtxStreamCreate)"
    return None


@dataclass
class _GreenSide:
    """One green context and the stream created in it."""

    sms: int  # SMs the driver actually granted
    context: Any  # CUgreenCtx
    raw_stream: Any  # CUstream
    stream: torch.cuda.Stream


class SmPartitioner(GpuSharing):
    """Disjoint decode/finetune SM sets via green contexts, every split created up front.

    ``partition(decode_sms)`` returns streams whose kernels run on ``decode_sms`` SMs and on the
    other ``total_sms - decode_sms`` SMs respectively. ``partition(total_sms)`` returns plain
    primary-context streams (decode high priority, finetune low): no spatial split.

    ``creation_s`` records how long creating all contexts took; ``granted`` the SM counts the
    driver actually granted per split (decode, finetune).
    """

    mechanism = "green_context"

    def __init__(self, device: torch.device, decode_groups: tuple[int, ...] | None = None) -> None:
        reason = green_context_unavailable_reason(device)
        if reason is not None:
            raise GreenContextError(reason)
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        torch.cuda.init()
        torch.empty(1, device=device)  # primary context must be current before splitting
        props = torch.cuda.get_device_properties(device)
        table = PartitionTable.build(
            props.multi_processor_count,
            decode_groups,
            granularity=sm_granularity(props.major),
            min_finetune_sms=2 * sm_granularity(props.major),
        )
        super().__init__(table, device)
        self._driver = load_driver()
        self._sides: dict[int, tuple[_GreenSide, _GreenSide]] = {}
        self.granted: dict[int, tuple[int, int]] = {}
        a, b = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        self._full = (
            torch.cuda.Stream(device=device, priority=min(a, b)),
            torch.cuda.Stream(device=device, priority=max(a, b)),
        )
        start = time.perf_counter()
        try:
            self._create_all(index)
        except Exception:
            self.close()
            raise
        self.creation_s = time.perf_counter() - start

    def _create_all(self, index: int) -> None:
        drv = self._driver
        cu_dev = _check(drv, "cuDeviceGet", drv.cuDeviceGet(index))
        sm_type = drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
        whole = _check(drv, "cuDeviceGetDevResource", drv.cuDeviceGetDevResource(cu_dev, sm_type))
        for decode_sms in self.table.decode_sms_options:
            groups, n_groups, remaining = _check(
                drv,
                "cuDevSmResourceSplitByCount",
                drv.cuDevSmResourceSplitByCount(1, whole, 0, decode_sms),
            )
            if int(n_groups) != 1:
                raise GreenContextError(f"split for {decode_sms} SMs gave {n_groups} groups")
            decode = self._side(cu_dev, groups[0])
            finetune = self._side(cu_dev, remaining)
            self._sides[decode_sms] = (decode, finetune)
            self.granted[decode_sms] = (decode.sms, finetune.sms)
            if decode.sms != decode_sms:
                raise GreenContextError(
                    f"asked for {decode_sms} decode SMs, the driver granted {decode.sms}"
                )

    def _side(self, cu_dev: Any, resource: Any) -> _GreenSide:
        drv = self._driver
        desc = _check(
            drv, "cuDevResourceGenerateDesc", drv.cuDevResourceGenerateDesc([resource], 1)
        )
        flags = drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        context = _check(drv, "cuGreenCtxCreate", drv.cuGreenCtxCreate(desc, cu_dev, flags))
        raw = _check(
            drv,
            "cuGreenCtxStreamCreate",
            drv.cuGreenCtxStreamCreate(context, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
        )
        stream = torch.cuda.get_stream_from_external(int(raw), self.device)
        return _GreenSide(
            sms=int(resource.sm.smCount), context=context, raw_stream=raw, stream=stream
        )

    def partition(self, decode_sms: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """(decode_stream, finetune_stream) of the split with ``decode_sms`` decode SMs."""
        self.table.get(decode_sms)  # PartitionError for a split that was not created
        if decode_sms == self.table.total_sms:
            return self._full
        if decode_sms not in self._sides:
            raise GreenContextError("SmPartitioner is closed")
        decode, finetune = self._sides[decode_sms]
        return decode.stream, finetune.stream

    def close(self) -> None:
        """Free dropped engines' graphs and cached allocator blocks (a graph captured in a
        green context must be gone before it is), synchronise, then destroy every stream and
        green context (idempotent). Graphs of an engine still alive must be dropped first."""
        if not self._sides:
            return
        from gpu_runtime.engine.cuda_graphs import free_dropped_captures

        free_dropped_captures(self.device)
        drv = self._driver
        sides, self._sides = self._sides, {}
        for pair in sides.values():
            for side in pair:
                _check(drv, "cuStreamDestroy", drv.cuStreamDestroy(side.raw_stream))
                _check(drv, "cuGreenCtxDestroy", drv.cuGreenCtxDestroy(side.context))
