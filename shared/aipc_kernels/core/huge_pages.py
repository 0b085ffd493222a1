"""CPU tensors on transparent huge pages: where a decode step's weights stream from.

A decode step reads every weight once, on few cores. On 4 KiB pages that read takes a TLB miss every
4 KiB and the hardware prefetchers stop at each page boundary; on 2 MiB pages neither happens. Linux
gives an anonymous mapping huge pages only where it is 2 MiB-aligned and, in the common ``madvise``
mode of ``/sys/kernel/mm/transparent_hugepage/enabled``, only where ``madvise(MADV_HUGEPAGE)`` asked
for them before the first touch; torch's allocator does neither by default. :func:`on_huge_pages`
copies a tensor into a fresh anonymous mapping whose 2 MiB-aligned interior is advised before the copy
touches it, so the pages are huge from the first fault (with THP's ``defrag`` setting deciding whether
the kernel compacts memory for them or falls back to small pages). The tail below 2 MiB stays on small
pages: no resident memory is added.

``AIPC_HUGE_PAGES=0`` turns it off (what the benchmarks' A/B rows set); it is a no-op where the
kernel has THP off (``never``), off Linux, and for tensors below :data:`MIN_BYTES`.
"""
from __future__ import annotations

import mmap
import os
import sys
from functools import cache
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
MIN_BYTES = HUGE_PAGE  # smaller tensors cannot hold one whole huge page
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@cache
def thp_mode() -> str:
    """The kernel's THP mode, the bracketed word of ``/sys/kernel/mm/transparent_hugepage/enabled``
    (``always``, ``madvise`` or ``never``); ``never`` where the file is absent or unreadable."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "never"


def enabled() -> bool:
    """Whether :func:`on_huge_pages` places tensors: Linux with THP ``always`` or ``madvise``, and
    ``AIPC_HUGE_PAGES`` not ``0``."""
    return (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
            and os.environ.get("AIPC_HUGE_PAGES", "1") != "0" and thp_mode() in ("always", "madvise"))  # fmt: skip


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy of ``t`` whose 2 MiB-aligned interior lies on transparent huge pages (the
    mapping lives as long as the tensor), or ``t`` itself where :func:`enabled` is false, ``t`` is
    smaller than :data:`MIN_BYTES`, not on the CPU or not contiguous."""
    nbytes = t.numel() * t.element_size()
    if nbytes < MIN_BYTES or t.device.type != "cpu" or not t.is_contiguous() or not enabled():
        return t
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping's buffer: the tensor keeps it alive
    start = -raw.data_ptr() % HUGE_PAGE
    huge = nbytes // HUGE_PAGE * HUGE_PAGE
    region.madvise(mmap.MADV_HUGEPAGE, start, huge)  # before the copy's first touch
    out = raw[start : start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
