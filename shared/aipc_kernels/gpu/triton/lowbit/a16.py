"""``a16``: the activation-exact W4A16 kernel of ``aipc::lowbit_linear_a16`` (CUDA / XPU, ``triton_k32``).

x is never quantized. A 4-bit code ``c`` becomes a float ``v`` of the dot's dtype, one of two ways on
the same skeleton (Transformer-Lite, Li et al.: FP4 vs INT4 dequantization), with ``w = s (c - z) =
A v + B`` per group:

* ``dequant="e0m4"``: ``v = 1 + c/16``, the code put into the fraction bits of 1.0 with a shift and
  an and-or (bf16 ``0x3F80 | c << 3``, fp16 ``0x3C00 | c << 6``, fp32 ``0x3F800000 | c << 19``);
  ``A = 16 s``, ``B = -s (16 + z)``;
* ``dequant="int"``: ``v = c``, a shift, a mask and an int-to-float conversion; ``A = s``, ``B = -s z``.

``y[m, n] = sum_g A[g, n] * dot_g(v[n], x[m]) + B[g, n] * xsum_g[m] + bias[n]``: each group's dot on
the matrix units in fp32 accumulation, ``xsum_g`` (the group sum of x's row) summed in fp32 in the
kernel from the tiles it loaded anyway. Both ``v`` are exact in every dot dtype (5 significant bits),
so the products are: bf16 x runs bf16 dots and fp16 x fp16 dots (exact products of 8/11-bit
mantissas), fp32 x fp32 dots with ``input_precision="ieee"`` (no tf32 rounding of x: FMAs instead of
the matrix units). Output in x's dtype.

Tile: [BLOCK_N, BLOCK_M] outputs (``WA``: the weights as the dot's A operand) or [BLOCK_M, BLOCK_N];
per 32-byte chunk of a row (64 k: plane 0 the low nibbles, k 0..31, plane 1 the high ones) one
[BLOCK_N, 32] byte load and two K=32 dots chained over the group (a group of 128 spans two chunks, a
whole row all of them); x beyond K (a row of K = 64j + 32 pads its last chunk) is loaded as 0.
``SPLIT_K`` programs per tile take whole groups (a whole row: whole chunks, each split's partial
rescaled alone), reduced by :func:`~.common.store_or_reduce` (``ATOMIC`` as for the ``group`` kernel).

Config: ``BLOCK_N``, ``BLOCK_M``, ``SPLIT_K``, ``num_warps``, ``num_stages``, ``WA``, ``GROUP_M``
(default 8), ``ATOMIC`` (default 0). Untuned: :func:`heuristic`; on a GPU the first call of a
problem times :data:`GEMV_SPACE` / :data:`GEMM_SPACE` and caches the winner under its own device
name (``<device>-a16``) through :mod:`.tuning`.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.lowbit.formats import get_codebook
from aipc_kernels.lowbit.contract import check_operands_a16
from aipc_kernels.lowbit.packing import TRITON_LAYOUT, PackedLowBit, triton_chunk
from aipc_kernels.gpu.triton.lowbit import tuning
from aipc_kernels.gpu.triton.lowbit.common import GEMV_MAX_M, dense_call, k_splits, path, sm_count, split_plan, store_or_reduce
from aipc_kernels.gpu.triton.lowbit.interpret import INTERPRETED, interpreter_scope

NAME = "a16"
# M <= 16: 16 token columns, weights as the A operand, split over K; M > 16: GEMM tiles
GEMV_SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": GEMV_MAX_M, "SPLIT_K": sk, "num_warps": 4, "num_stages": ns, "WA": 1}
    for bn in (64, 128)
    for sk in (1, 2, 4, 8)
    for ns in (3, 4)
]
GEMM_SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": bm, "SPLIT_K": 1, "num_warps": nw, "num_stages": ns, "WA": 1}
    for bn, bm, nw, ns in ((128, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 3), (256, 64, 8, 3), (64, 128, 4, 3))
]
FIELDS = ("BLOCK_N", "BLOCK_M", "SPLIT_K", "num_warps", "num_stages")


@triton.jit
def _values(wb, q: tl.constexpr, E0M4: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr):
    """The codes of bit-plane ``q`` (0: low nibbles, 1: high) of the bytes ``wb`` as dot operands of
    dtype ``DT``: E0M4 ``1 + c/16`` (the code shifted to the top of the fraction and or-ed into the
    bits of 1.0), else ``c`` (shift, mask, int-to-float conversion; the interpreter converts integers
    to bf16 as raw bits, so there through fp32)."""
    if E0M4:
        if DT == tl.bfloat16:  # 1.0 = 0x3F80, code at bit 3
            w = wb.to(tl.uint16)
            if q == 0:
                bits = ((w << 3) & 0x78) | 0x3F80
            else:
                bits = ((w >> 1) & 0x78) | 0x3F80
            return bits.to(tl.bfloat16, bitcast=True)
        elif DT == tl.float16:  # 1.0 = 0x3C00, code at bit 6
            w = wb.to(tl.uint16)
            if q == 0:
                bits = ((w << 6) & 0x3C0) | 0x3C00
            else:
                bits = ((w << 2) & 0x3C0) | 0x3C00
            return bits.to(tl.float16, bitcast=True)
        else:  # fp32: 1.0 = 0x3F800000, code at bit 19
            w = wb.to(tl.uint32)
            if q == 0:
                bits = ((w << 19) & 0x780000) | 0x3F800000
            else:
                bits = ((w << 15) & 0x780000) | 0x3F800000
            return bits.to(tl.float32, bitcast=True)
    elif INTERP:
        return ((wb >> (4 * q)) & 0xF).to(tl.float32).to(DT)
    else:
        return ((wb >> (4 * q)) & 0xF).to(DT)


@triton.jit
def _dot(a, b, d, DT: tl.constexpr, INTERP: tl.constexpr):
    """``d + a @ b`` in fp32: bf16/fp16 operands on the matrix units, fp32 ones without tf32 rounding.
    The interpreter multiplies bf16 operands as their raw bits: there they go through fp32 (exact,
    the same products)."""
    if DT == tl.float32:
        return tl.dot(a, b, d, input_precision="ieee")
    elif INTERP and DT == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), d, input_precision="ieee")
    else:
        return tl.dot(a, b, d)


@triton.jit
def _a16_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K, NG, KB, STEPS_PER_SPLIT,
    ZERO: tl.constexpr, G: tl.constexpr, WHOLE_ROW: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr,
    E0M4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, WA: tl.constexpr,
    SPLIT_K: tl.constexpr, ATOMIC: tl.constexpr, FENCE: tl.constexpr, INTERP: tl.constexpr,
):
    """One output tile over a K range of whole steps (a step: one group of 128 = two chunks, else one
    chunk); ``d`` carries the group's fp32 dot and ``xs`` its activations summed per column until the
    group ends (G = 32: each plane; 64: each chunk; 128: each step; a whole row: the program's range),
    then ``acc += A * d + B * sum(xs)``. (A row sum carried over the loop instead crashed Triton 3.6's
    OptimizeThreadLocality pass with fp32 FMA dots and whole rows.)"""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    CPS: tl.constexpr = 2 if (G == 128 and not WHOLE_ROW) else 1  # chunks per step
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsz = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsz
    pid_n = (pid % width) // gsz
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rm = tl.where(m_mask, offs_m, 0)  # clamped rows: unmasked loads, results dropped at the store
    rn = tl.where(n_mask, offs_n, 0)
    j = tl.arange(0, 32)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * K + j[None, :]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * KB + j[None, :]
    if WA:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    d = tl.zeros_like(acc)
    xs = tl.zeros([BLOCK_M, 32], dtype=tl.float32)  # the group's x summed per column, reduced at its end
    n_steps = KB // (32 * CPS)
    if SPLIT_K == 1:
        s_begin = 0
        s_end = n_steps
    else:
        s_begin = pid_k * STEPS_PER_SPLIT
        s_end = tl.minimum(s_begin + STEPS_PER_SPLIT, n_steps)
    for st in range(s_begin, s_end):
        for cc in tl.static_range(CPS):
            c = st * CPS + cc
            wb = tl.load(w_rows + c * 32)  # [BLOCK_N, 32] bytes: two planes of 32 k
            for q in tl.static_range(2):
                v = _values(wb, q, E0M4, DT, INTERP)
                k0 = c * 64 + q * 32
                xt = tl.load(x_rows + k0, mask=(k0 + j < K)[None, :], other=0.0)  # [BLOCK_M, 32]
                if WA:
                    d = _dot(v, tl.trans(xt), d, DT, INTERP)
                else:
                    d = _dot(xt, tl.trans(v), d, DT, INTERP)
                xs += xt.to(tl.float32)
                if WHOLE_ROW:
                    flush = False
                elif G == 32:
                    flush = True
                elif G == 64:
                    flush = q == 1
                else:
                    flush = q == 1 and cc == CPS - 1
                if flush:
                    gi = tl.minimum(k0 // G, NG - 1)  # a padded plane (d and xs zero) adds nothing to the last group
                    acc = _rescale(acc, d, tl.sum(xs, axis=1), s_ptr, z_ptr, gi * N + rn, ZERO, HAS_ZEROS, E0M4, WA)
                    d = tl.zeros_like(acc)
                    xs = tl.zeros([BLOCK_M, 32], dtype=tl.float32)
    if WHOLE_ROW:
        acc = _rescale(acc, d, tl.sum(xs, axis=1), s_ptr, z_ptr, rn, ZERO, HAS_ZEROS, E0M4, WA)
    if WA:
        bias = tl.load(b_ptr + rn).to(tl.float32)[:, None] if HAS_BIAS else 0.0
        out_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        omask = n_mask[:, None] & m_mask[None, :]
    else:
        bias = tl.load(b_ptr + rn).to(tl.float32)[None, :] if HAS_BIAS else 0.0
        out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        omask = m_mask[:, None] & n_mask[None, :]
    store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, out_offs, omask, M * N, pid_k, pid, SPLIT_K, HAS_BIAS, ATOMIC, FENCE)


@triton.jit
def _rescale(acc, d, xs, s_ptr, z_ptr, g_offs, ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, E0M4: tl.constexpr,
             WA: tl.constexpr):  # fmt: skip
    """``acc + A * d + B * xs`` for the group scales (zeros) at ``g_offs`` (one per output row):
    E0M4 ``A = 16 s, B = -s (16 + z)``; int ``A = s, B = -s z``."""
    s = tl.load(s_ptr + g_offs).to(tl.float32)
    z = tl.load(z_ptr + g_offs).to(tl.float32) if HAS_ZEROS else ZERO
    if E0M4:
        a = 16.0 * s
        b = -s * (16.0 + z)
    else:
        a = s
        b = -s * z
    if WA:
        return acc + a[:, None] * d + b[:, None] * xs[None, :]
    else:
        return acc + d * a[None, :] + xs[:, None] * b[None, :]


def heuristic(M: int, N: int, K: int, device: torch.device) -> dict:
    """The untuned default. M > 16: a [128 rows, 64 tokens] tile; M <= 16: 16 token columns, split over
    K (at most 8) until the device has two programs per SM."""
    if path(M) == "gemm":
        return {"KERNEL": NAME, "BLOCK_N": 128, "BLOCK_M": 64, "SPLIT_K": 1, "num_warps": 4, "num_stages": 3, "WA": 1}
    bn = 128 if N >= 2048 else 64
    split = k_splits(-(-N // bn), -(-K // 128), 8, 2 * sm_count(device))
    return {"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": GEMV_MAX_M, "SPLIT_K": split, "num_warps": 4, "num_stages": 3, "WA": 1}


def check_config(cfg: dict) -> dict:
    """``cfg`` if it is an ``a16`` config with every field, else a ValueError naming what is wrong."""
    if cfg.get("KERNEL", NAME) != NAME:
        raise ValueError(f"config={cfg}: KERNEL={cfg['KERNEL']!r} is not the W4A16 kernel; use KERNEL={NAME!r}")
    missing = [f for f in FIELDS if f not in cfg]
    if missing:
        raise ValueError(f"config={cfg} lacks {missing} for the {NAME} kernel; give {FIELDS}")
    return cfg


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           dequant: str) -> None:  # fmt: skip
    """Runs ``cfg`` on dense operands (checked), writing ``y [M, N]``."""
    M, K = x2.shape
    N = weight.out_features
    cb = get_codebook(weight.codebook)
    whole = weight.group_size == K
    G = K if whole else weight.group_size
    bn, bm = cfg["BLOCK_N"], cfg["BLOCK_M"]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    cps = 2 if G == 128 and not whole else 1
    steps = weight.qweight.shape[1] // 32 // cps
    split, per_split, ws, locks, atomic = split_plan(steps, cfg["SPLIT_K"], tiles, M, N, y, atomic=bool(cfg.get("ATOMIC", 0)))
    with interpreter_scope():
        _a16_kernel[(tiles, split)](
            x_ptr=x2, w_ptr=weight.qweight, s_ptr=weight.scales,
            z_ptr=weight.scales if weight.zeros is None else weight.zeros,
            b_ptr=weight.scales if bias is None else bias, y_ptr=y, ws_ptr=ws, lock_ptr=locks,
            M=M, N=N, K=K, NG=weight.scales.shape[0], KB=weight.qweight.shape[1], STEPS_PER_SPLIT=per_split,
            ZERO=0.0 if cb.zero is None else float(cb.zero), G=G, WHOLE_ROW=whole,
            HAS_ZEROS=weight.zeros is not None, HAS_BIAS=bias is not None, E0M4=dequant == "e0m4",
            BLOCK_M=bm, BLOCK_N=bn, GROUP_M=cfg.get("GROUP_M", 8), WA=bool(cfg["WA"]), SPLIT_K=split,
            ATOMIC=atomic, FENCE=x2.device.type == "cuda" and not INTERPRETED, INTERP=INTERPRETED,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip


def config_key(x2: torch.Tensor, weight: PackedLowBit, dequant: str) -> str:
    """The tuning-cache key: the W*A8 key (path, M bucket, N, K, group, bits) with x's dtype and ``dequant``."""
    key = tuning.config_key(x2.shape[0], weight.out_features, x2.shape[1], weight.group_size, weight.bits)
    return f"{key}:{str(x2.dtype).removeprefix('torch.')}:{dequant}"


def select_config(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor,
                  dequant: str) -> dict:  # fmt: skip
    """The cached config of this problem (device ``<name>-a16``), else, with tuning on, the fastest of
    this path's space (timed as :func:`.tuning.tune` does, then cached), else the heuristic."""
    M, K = x2.shape
    dev = x2.device
    name = f"{tuning.device_name(dev)}-{NAME}"
    key = config_key(x2, weight, dequant)
    cfgs = tuning.cached_configs(name, kernels=(NAME,))
    if key in cfgs:
        return cfgs[key]
    capturing = dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not tuning.autotune_enabled(dev) or capturing:
        return heuristic(M, weight.out_features, K, dev)
    best, best_t = None, float("inf")
    weights = tuning.weight_copies(weight, dev, M)
    for cfg in GEMM_SPACE if path(M) == "gemm" else GEMV_SPACE:
        try:
            t = tuning.time_per_call(lambda w: launch(x2, w, bias, y, cfg, dequant), weights, dev)
        except Exception:  # noqa: BLE001 - a config the device cannot compile (shared memory, registers)
            continue
        if t < best_t:
            best, best_t = cfg, t
    if best is None:
        raise RuntimeError(f"lowbit_linear_a16: no Triton configuration ran for {key}")
    best = dict(best, us=round(best_t * 1e3, 2))
    tuning.save_config(name, key, best)
    return best


def lowbit_linear_a16_triton(
    x: torch.Tensor,
    weight: PackedLowBit,
    bias: Optional[torch.Tensor] = None,
    dequant: str = "e0m4",
    config: Optional[dict] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``x @ W^T + bias`` for a 4-bit ``triton_k32`` weight, x unquantized (see the module docstring).

    ``config`` overrides the tuned tile; ``out`` (contiguous, x's dtype, ``M * N`` elements) receives the
    result instead of a new tensor."""
    check_operands_a16(x, weight.qweight, weight.scales, weight.zeros, bias, weight.layout, weight.codebook,
                       weight.group_size, weight.out_features, dequant)  # fmt: skip
    if weight.layout != TRITON_LAYOUT:
        raise ValueError(
            f"weight.layout={weight.layout!r}: the Triton kernels need {TRITON_LAYOUT!r}; "
            f"pack it with aipc_kernels.lowbit.packing.pack_for_triton"
        )
    K, N = x.shape[-1], weight.out_features
    if weight.in_features != K:
        raise ValueError(f"lowbit_linear_a16: weight of in_features={weight.in_features} does not match x's K={K}")
    assert triton_chunk(weight.bits) == 64  # 4-bit codes: two planes of 32 k per 32-byte chunk
    x2, weight, bias, y = dense_call(x, weight, bias, out)
    if x2.shape[0] == 0:
        return y.view(*x.shape[:-1], N)
    cfg = check_config(config) if config is not None else select_config(x2, weight, bias, y, dequant)
    launch(x2, weight, bias, y, cfg, dequant)
    return y.view(*x.shape[:-1], N)
