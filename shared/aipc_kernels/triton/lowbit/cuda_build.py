"""Compiling the CUDA C kernels (``cuda_stream.cu``, ``cuda_mma.cu``) at first use: NVRTC through
``torch.cuda._compile_kernel`` (no CUDA toolkit on the user's machine), one compile per variant (a tuple
of macro values) and process. The source is the variant's ``#define``s, ``cuda_common.cuh`` (what the
kernels share), then the kernel's own file."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from .interpret import INTERPRETED

COMMON = Path(__file__).with_name("cuda_common.cuh")
KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # IN_KIND / SCALE_KIND of a dtype
_compiled: dict[tuple, object] = {}
_lock = threading.Lock()


def nvrtc_available(device: torch.device) -> bool:
    """Compiled CUDA (not the Triton interpreter) with torch's NVRTC entry (``torch.cuda._compile_kernel``)."""
    return device.type == "cuda" and not INTERPRETED and torch.version.cuda is not None and hasattr(torch.cuda, "_compile_kernel")


def compiled(source: Path, kernel: str, names: tuple[str, ...], values: tuple) -> object:
    """The kernel ``kernel`` of ``source`` compiled with ``#define name value`` for each pair (cached)."""
    key = (source.name, kernel, values)
    with _lock:
        if key not in _compiled:
            defines = "".join(f"#define {n} {v}\n" for n, v in zip(names, values, strict=True))
            text = defines + COMMON.read_text() + source.read_text()
            _compiled[key] = torch.cuda._compile_kernel(text, kernel, nvcc_options=["-std=c++17"])
        return _compiled[key]


def float_literal(v: float) -> str:
    """``v`` as an exact C float literal for a macro (hexadecimal, cast to float)."""
    return f"((float){float(v).hex()})"
