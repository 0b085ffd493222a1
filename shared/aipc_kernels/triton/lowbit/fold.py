"""``fold``: prompts on the 16-bit float matrix units, each group's scale folded into the weight operand.

The ``group`` kernel's int8 dot needs one fp32 rescale of its accumulator per (output, group): CUDA-core
work as large as the tile's int8 MMA, serialised with it (docs/triton.md, Bounds). Here the accumulator
is never touched inside the K loop: the activation pass writes the same int8 codes as fp16/bf16 (x's
dtype; integers up to 127 are exact in both), each weight code becomes ``s * (cmul * c - zero)`` rounded
once to that dtype while it is unpacked, and one chained ``tl.dot`` per 32-k plane accumulates in fp32;
the per-token scale and the bias come at the end. So the matrix units run at the 16-bit rate (half the
int8 rate) but the per-group rescale is gone and the K loop is a plain float GEMM loop.

Numerics: the activations are exact (the op's int8 codes), the products of a 16-bit weight and a code
exact in fp32; the weight is rounded once to x's dtype, as in the ``dequant`` path (bit for bit
``LowBitWeight.dequantize().to(dtype)`` where the scale is of x's dtype; a scale of another dtype is
rounded to x's first on the PTX path). fp32 activations would need fp32 operands (no 16-bit rounding
of the weight): they run the ``group`` kernel with the same tile instead.

On CUDA (``HW_ASM``, code books without stored zeros, 2 or 4 bits) four codes become four 16-bit values
in 9 PTX instructions: shift and mask the bytes, ``prmt`` each under the high byte of a power of two
(bf16 128, fp16 1024, so the value is that power plus the code), one packed ``fma`` subtracts the
power and the code book's integer zero, one multiplies by the (pre-multiplied) scale. Elsewhere (the
interpreter, XPU, stored zeros, 1 and 8 bits) the same value in fp32, rounded to x's dtype.

Config: ``BLOCK_N``, ``BLOCK_M``, ``num_warps``, ``num_stages``, ``WA`` (weights as the dot's A operand),
``SPLIT_K`` (default 1), ``ATOMIC`` (default 0), ``GROUP_M`` (default 8): the ``group`` kernel's fields.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...formats import get_codebook
from ...packing import PackedLowBit, triton_chunk
from . import group
from .activation import quantize_rows
from .common import GEMV_MAX_M, float_dot, path, round_to, split_plan, store_or_reduce
from .interpret import INTERPRETED

NAME = "fold"
# M > 16: (BLOCK_N, BLOCK_M, num_warps, num_stages), weights as the A operand
_GEMM_TILES = [(128, 128, 8, 3), (128, 64, 4, 3), (128, 256, 8, 3), (256, 128, 8, 3), (64, 128, 4, 3),
               (128, 128, 4, 4), (256, 64, 8, 3), (128, 128, 8, 4)]
GEMM_SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": bm, "num_warps": nw, "num_stages": ns, "WA": 1} for bn, bm, nw, ns in _GEMM_TILES
]
# 16 < M <= group.SPLIT_GEMM_MAX_M: split over K too (few output tiles)
GEMM_SPLIT_SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": bm, "num_warps": 4, "num_stages": 3, "WA": 1, "SPLIT_K": sk}
    for bn, bm in ((128, 64), (64, 64))
    for sk in (2, 4, 8)
]
# 1 < M <= 16: 16 token columns, split over K
GEMV_SPACE = [
    {"KERNEL": NAME, "BLOCK_N": bn, "BLOCK_M": GEMV_MAX_M, "SPLIT_K": sk, "num_warps": 4, "num_stages": ns, "WA": 1}
    for bn in (64, 128)
    for sk in (2, 4, 8, 16)
    for ns in (3, 4)
]
_MAGIC = {torch.bfloat16: (0x43, 128.0), torch.float16: (0x64, 1024.0)}  # high byte of a power of two, its value


@triton.jit
def _plane_values(wb, s, z, q: tl.constexpr, BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr,
                  HAS_ZEROS: tl.constexpr, DT: tl.constexpr, HW_ASM: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """The [BLOCK_N, 32] weights of bit-plane ``q`` of the bytes ``wb`` in dtype ``DT``: ``s * (CMUL * c
    - zero)`` per row (``s``, ``z``: [BLOCK_N] scales and stored zeros of the plane's group). ``HW_ASM``:
    four codes per PTX call, ``s`` of DT already times the code book's integer factor."""
    if HW_ASM:
        sb = tl.broadcast_to(s[:, None], wb.shape)
        return tl.inline_asm_elementwise(ASM, "=r,=r,r,r,r", [wb, sb], dtype=DT.value, is_pure=True, pack=4)
    else:
        code = ((wb.to(tl.int32) >> (BITS * q)) & ((1 << BITS) - 1)).to(tl.float32)
        if HAS_ZEROS:
            v = code * CMUL - z.to(tl.float32)[:, None]
        else:
            v = code * CMUL - ZERO
        return round_to(s.to(tl.float32)[:, None] * v, DT)


@triton.jit
def _fold_kernel(
    xq_ptr, sx_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, Kp, NG, KB, CHUNKS_PER_SPLIT, FMUL,
    BITS: tl.constexpr, CMUL: tl.constexpr, ZERO: tl.constexpr, G: tl.constexpr, HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, WA: tl.constexpr,
    HW_ASM: tl.constexpr, ASM0: tl.constexpr, ASM1: tl.constexpr, ASM2: tl.constexpr, ASM3: tl.constexpr,
    SPLIT_K: tl.constexpr, ATOMIC: tl.constexpr, INTERP: tl.constexpr,
):
    """One [BLOCK_N, BLOCK_M] output tile (``WA``; else [BLOCK_M, BLOCK_N]): per 32-byte chunk of the
    rows, one [BLOCK_N, 32] byte load; per bit-plane its group's scales, the plane's weights in x's
    dtype and one K=32 dot against the [BLOCK_M, 32] codes, chained in fp32 over the program's K range
    (``SPLIT_K``: program_id(1) takes CHUNKS_PER_SPLIT chunks, reduced as in ``group``); then ``* sx +
    bias``. ``G``: the group (K itself for one group per row; padded k past it clamped to the last)."""
    P: tl.constexpr = 8 // BITS
    KC: tl.constexpr = 32 * P
    DT: tl.constexpr = xq_ptr.dtype.element_ty
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
    x_rows = xq_ptr + rm[:, None].to(tl.int64) * Kp + j[None, :]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * KB + j[None, :]
    if WA:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_chunks = Kp // KC
    if SPLIT_K == 1:
        c_begin = 0
        c_end = n_chunks
    else:
        c_begin = pid_k * CHUNKS_PER_SPLIT
        c_end = tl.minimum(c_begin + CHUNKS_PER_SPLIT, n_chunks)
    for c in range(c_begin, c_end):
        wb = tl.load(w_rows + c * 32)  # [BLOCK_N, 32] bytes, P planes
        for q in tl.static_range(P):
            g = tl.minimum((c * KC + q * 32) // G, NG - 1)
            s = tl.load(s_ptr + g * N + rn)
            if HW_ASM:
                s = (s.to(tl.float32) * FMUL).to(DT)
            z = tl.load(z_ptr + g * N + rn) if HAS_ZEROS else s
            if not HW_ASM:
                w = _plane_values(wb, s, z, q, BITS, CMUL, ZERO, HAS_ZEROS, DT, False, "")
            elif q == 0:
                w = _plane_values(wb, s, z, 0, BITS, CMUL, ZERO, HAS_ZEROS, DT, HW_ASM, ASM0)
            elif q == 1:
                w = _plane_values(wb, s, z, 1, BITS, CMUL, ZERO, HAS_ZEROS, DT, HW_ASM, ASM1)
            elif q == 2:
                w = _plane_values(wb, s, z, 2, BITS, CMUL, ZERO, HAS_ZEROS, DT, HW_ASM, ASM2)
            else:
                w = _plane_values(wb, s, z, 3, BITS, CMUL, ZERO, HAS_ZEROS, DT, HW_ASM, ASM3)
            xt = tl.load(x_rows + (c * KC + q * 32))  # [BLOCK_M, 32] codes in DT
            if WA:
                acc = float_dot(w, tl.trans(xt), acc, DT, INTERP)
            else:
                acc = float_dot(xt, tl.trans(w), acc, DT, INTERP)
    sx = tl.load(sx_ptr + rm)
    if WA:
        acc = acc * sx[None, :]
        bias = tl.load(b_ptr + rn).to(tl.float32)[:, None] if HAS_BIAS else 0.0
        out_offs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        omask = n_mask[:, None] & m_mask[None, :]
    else:
        acc = acc * sx[:, None]
        bias = tl.load(b_ptr + rn).to(tl.float32)[None, :] if HAS_BIAS else 0.0
        out_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        omask = m_mask[:, None] & n_mask[None, :]
    store_or_reduce(acc, bias, y_ptr, ws_ptr, lock_ptr, out_offs, omask, M * N, pid_k, pid, SPLIT_K, HAS_BIAS, ATOMIC, HW_ASM)


def _bits16(v: float, dtype: torch.dtype) -> int:
    """The 16 bits of ``v`` in ``dtype`` (which must hold it exactly)."""
    t = torch.tensor(v, dtype=dtype)
    if float(t) != v:
        raise ValueError(f"{v} is not exact in {dtype}")
    return int(t.view(torch.int16)) & 0xFFFF


def plane_asm(bits: int, q: int, ca: int, cb: int, dtype: torch.dtype) -> str:
    """PTX of :func:`_plane_values` for four packed code bytes ``$2`` and their scales ``$3``, ``$4`` (two
    16-bit pairs of ``dtype``): ``(CA * c - CB) * s`` per code, exact up to the one rounding of the
    product. The byte ``CA * c`` (< 128) is put under the high byte of a power of two P (bf16 128, fp16
    1024), so the 16-bit value is P + CA * c; one packed fma takes P + CB off (exact: small integers),
    one multiplies by s (an fma with -0.0 keeps the sign of a zero product)."""
    hi, base = _MAGIC[dtype]
    ty = "bf16x2" if dtype == torch.bfloat16 else "f16x2"
    pair = lambda v: f"{_bits16(v, dtype) * 0x10001:#010x}"  # noqa: E731 - one 16-bit value in both halves
    s = [f"shr.u32 t, $2, {bits * q};" if q else "mov.b32 t, $2;", f"and.b32 t, t, {0x01010101 * ((1 << bits) - 1):#010x};"]
    if ca != 1:
        s.append(f"mul.lo.u32 t, t, {ca};")
    s += [
        f"mov.b32 off, {0x01010101 * hi:#010x};",
        "prmt.b32 a, t, off, 0x4140;",  # bytes c0, hi, c1, hi: codes 0 and 1
        "prmt.b32 b, t, off, 0x4342;",  # codes 2 and 3
        f"mov.b32 one, {pair(1.0)};",
        f"mov.b32 off, {pair(-(base + cb))};",
        f"fma.rn.{ty} a, a, one, off;",
        f"fma.rn.{ty} b, b, one, off;",
        "mov.b32 off, 0x80008000;",
        f"fma.rn.{ty} $0, a, $3, off;",
        f"fma.rn.{ty} $1, b, $4, off;",
    ]
    return "{ .reg .b32 t, a, b, one, off; " + " ".join(s) + " }"


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens (none at M == 1: the stream kernel's)."""
    if path(M) == "gemm":
        return GEMM_SPACE + (GEMM_SPLIT_SPACE if M <= group.SPLIT_GEMM_MAX_M else [])
    return [] if M == 1 else list(GEMV_SPACE)


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> Optional[dict]:
    """Not an untuned default (None): it has not been measured against ``group``/``dequant`` on a GPU
    without tuning."""
    return None


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The activation pass (codes in x's dtype) and the fold kernel for ``x2 [M, K]``, writing ``y [M, N]``;
    fp32 ``x2``: the ``group`` kernel with the same tile."""
    if x2.dtype not in _MAGIC:
        group.launch(x2, weight, bias, y, cfg, act_amax)
        return
    M, K = x2.shape
    N = weight.out_features
    cb = get_codebook(weight.codebook)
    Kp = weight.qweight.shape[1] * (8 // cb.bits)
    xq, sx, _ = quantize_rows(x2, Kp, sums=False, act_amax=act_amax, codes_dtype=x2.dtype)
    bn, bm = cfg["BLOCK_N"], cfg.get("BLOCK_M", GEMV_MAX_M)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split, per_split, ws, locks, atomic = split_plan(
        Kp // triton_chunk(cb.bits), cfg.get("SPLIT_K", 1), tiles, M, N, y, atomic=bool(cfg.get("ATOMIC", 0))
    )
    ca, cbias, fmul = group.int_codebook(cb)
    hw = x2.device.type == "cuda" and not INTERPRETED and weight.zeros is None and cb.bits in (2, 4)
    asm = {f"ASM{q}": plane_asm(cb.bits, q, ca, cbias, x2.dtype) if hw and q < 8 // cb.bits else "" for q in range(4)}
    _fold_kernel[(tiles, split)](
        xq_ptr=xq, sx_ptr=sx, w_ptr=weight.qweight, s_ptr=weight.scales,
        z_ptr=weight.scales if weight.zeros is None else weight.zeros,
        b_ptr=weight.scales if bias is None else bias, y_ptr=y, ws_ptr=ws, lock_ptr=locks,
        M=M, N=N, Kp=Kp, NG=weight.scales.shape[0], KB=weight.qweight.shape[1], CHUNKS_PER_SPLIT=per_split, FMUL=fmul,
        BITS=cb.bits, CMUL=float(cb.cmul), ZERO=float(cb.zero or 0.0), G=K if weight.group_size == K else weight.group_size,
        HAS_ZEROS=weight.zeros is not None, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn,
        GROUP_M=cfg.get("GROUP_M", 8), WA=bool(cfg.get("WA", 1)), HW_ASM=hw, **asm,
        SPLIT_K=split, ATOMIC=atomic, INTERP=INTERPRETED, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
