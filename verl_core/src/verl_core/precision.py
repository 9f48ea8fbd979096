"""``autocast`` settings shared by training backends and rollout engines (``backend.autocast``,
``rollout.autocast``): one set of accepted values, one error, one context."""

from __future__ import annotations

import contextlib

import torch

#: What an ``autocast`` setting accepts: off, or the lower-precision dtype the forwards run in.
AUTOCAST_CHOICES = ("off", "bfloat16", "float16")


def check_autocast(value: str) -> None:
    """Raise ``ValueError`` naming the field when ``value`` is not an ``autocast`` choice."""
    if value not in AUTOCAST_CHOICES:
        raise ValueError(f"autocast: must be 'off', 'bfloat16' or 'float16', not {value!r}")


def autocast(device_type: str, value: str) -> contextlib.AbstractContextManager:
    """The forwards' lower-precision region for ``value`` (a null context when ``"off"``). Backward runs
    outside it, as autocast wants: each op's backward in the dtype its forward ran in."""
    if value == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=getattr(torch, value))
