"""What the benchmarks say about the machine they ran on (results name the CPU: figures differ with it)."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def bf16_flags() -> str:
    """The CPU's bf16 matmul instructions as /proc/cpuinfo names them (``avx512_bf16``, ``amx_bf16``), or
    ``no bf16 instructions``: whether lower precision can be faster here at all."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                found = [f for f in ("avx512_bf16", "amx_bf16", "amx_tile") if f in line.split()]
                return ", ".join(found) or "no bf16 instructions"
    except OSError:
        pass
    return "flags unknown"
