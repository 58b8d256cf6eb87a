"""Choosing the sharing mechanism for a host: green contexts when they work, else streams."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from gpu_runtime.sharing.base import GpuSharing
from gpu_runtime.sharing.green import (
    GreenContextError,
    SmPartitioner,
    green_context_unavailable_reason,
)
from gpu_runtime.sharing.streams import StreamSharing

logger = logging.getLogger(__name__)

MECHANISMS = ("green_context", "streams")


@dataclass(frozen=True)
class MechanismChoice:
    """The mechanism to build and, when it is not the preferred one, why."""

    mechanism: str
    fallback_reason: str | None


def choose_mechanism(
    prefer: str, green_unavailable_reason: str | None, *, strict: bool = False
) -> MechanismChoice:
    """Pure decision: ``prefer`` unless it is green contexts and those are unavailable.

    Raises ValueError for an unknown mechanism, and GreenContextError when ``strict`` forbids
    falling back.
    """
    if prefer not in MECHANISMS:
        raise ValueError(f"unknown sharing mechanism {prefer!r}; expected one of {MECHANISMS}")
    if prefer == "streams":
        return MechanismChoice("streams", None)
    if green_unavailable_reason is None:
        return MechanismChoice("green_context", None)
    if strict:
        raise GreenContextError(f"green contexts unavailable: {green_unavailable_reason}")
    return MechanismChoice("streams", green_unavailable_reason)


def create_sharing(
    device: torch.device,
    prefer: str = "green_context",
    decode_groups: tuple[int, ...] | None = None,
    *,
    strict: bool = False,
) -> GpuSharing:
    """Build the host's sharing object; falls back to StreamSharing (logged) unless ``strict``."""
    reason = green_context_unavailable_reason(device) if prefer == "green_context" else None
    choice = choose_mechanism(prefer, reason, strict=strict)
    if choice.mechanism == "green_context":
        try:
            return SmPartitioner(device, decode_groups)
        except GreenContextError as exc:
            choice = choose_mechanism(prefer, str(exc), strict=strict)
    if choice.fallback_reason is not None:
        logger.warning("GPU sharing falls back to streams: %s", choice.fallback_reason)
    return StreamSharing(device)
