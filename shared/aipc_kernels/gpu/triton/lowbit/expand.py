"""``expand``: prompts (M > 16) on the progressive two-level form as one pass that writes the weight's int8
levels, then an int8 GEMM.

The form's levels ``w8 = s1 * c + m`` are exact int8 (:mod:`aipc_kernels.lowbit.progressive`), so the
weight can be expanded once per call into a dense int8 ``[N, Kp]`` (K-contiguous: ``(s1 * c + m)`` of each
code, four codes per 32-bit register, :func:`~.progressive._levels`), and the product is a plain int8 GEMM
``xq [M, Kp] @ w8^T`` with both operands K-major (on Hopper ``tl.dot`` lowers to wgmma from shared
memory), int32 accumulation over the whole K and one ``acc * sx[m] * s0[n]`` per output. The activation pass and
the (first row chunk's) expansion run in one launch, side by side (:func:`_prepass`). The expansion
reads the 2- or 4-bit codes once and writes 1 byte a weight (8B gate/up: 59 MB); it pays where the GEMM's
time hides it, a long prompt. Same values as the fused ``progressive`` kernel: each output is the same
exact int32 sum, one float conversion and two products.

Config: ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``, ``num_warps``, ``num_stages``, ``GROUP_M`` (default 8),
``ROW_CHUNKS`` (default 1): the expansion and the GEMM taken in that many chunks of the weight's rows (whole output
tiles each), one after the other through one buffer of a chunk's levels, so that the GEMM reads levels the expansion
has just written to the L2 instead of HBM (a gain where a chunk's tiles still fill the GPU: the large-N shapes);
``WS`` (default 0): the GEMM as the warp-specialized Gluon kernel of :mod:`.gluon_gemm` (Hopper: TMA producer,
asynchronous wgmma), its fields ``PW``, ``PRODUCER_REGS`` and ``PERSISTENT``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.lowbit.packing import PackedLowBit, triton_chunk
from aipc_kernels.gpu.triton.lowbit import gluon_gemm
from aipc_kernels.gpu.triton.lowbit.activation import quant_row_slice, row_program
from aipc_kernels.gpu.triton.lowbit.common import grouped_tile, path
from aipc_kernels.gpu.triton.lowbit.progressive import check, group_scales

NAME = "expand"
FORMS = ("progressive",)  # a kernel of the progressive two-level form (registry.takes), and only of it
FIELDS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
# the last tile: for shapes with fewer 64 x 128 output tiles than SMs (the kv shapes, the 1B shapes at M <= 1024)
_TILES = [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (256, 128, 128, 8, 3), (64, 128, 128, 4, 4),
          (128, 128, 128, 4, 3), (128, 128, 128, 8, 4), (128, 256, 128, 8, 4), (128, 128, 256, 8, 3),
          (64, 64, 128, 4, 4)]  # fmt: skip
SPACE = [{"KERNEL": NAME, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}
         for bm, bn, bk, nw, ns in _TILES]  # fmt: skip
SPACE += [dict(SPACE[0], ROW_CHUNKS=rc) for rc in (2, 4)]  # the first tile in row chunks
# the Gluon GEMM (WS=1, compiled sm_90 only): 128 x 256 and 128 x 128 tiles of two consumer warpgroups, a program a
# tile or (PERSISTENT=1) a program an SM
WS_SPACE = [dict(SPACE[0], BLOCK_N=bn, num_stages=ns, WS=1, **({"PERSISTENT": 1} if p else {}))
            for p in (0, 1) for bn, ns in ((256, 4), (256, 3), (128, 4))]  # fmt: skip
EXPAND_ROWS = 32  # weight rows per program of the expansion pass
EXPAND_CHUNKS = 2  # chunks of k per program of the expansion pass, where the chunks divide by it
MIN_M = 1024  # the untuned heuristic's threshold (it won every M >= 1024 case of the H200 probes)


@triton.jit
def _plane_words(wv, s_ptr, m_ptr, rn, c, q: tl.constexpr, N, NG, BITS: tl.constexpr, G: tl.constexpr):
    """Bit-plane ``q``'s levels + 128 of the code words ``wv`` ([BLOCK_N, 8] uint32), four bytes a word."""
    s1, m = group_scales(s_ptr, m_ptr, rn, c, q, N, NG, BITS, G)
    mask: tl.constexpr = 0x01010101 * ((1 << BITS) - 1)
    bias = (m.to(tl.int32) + 128).to(tl.uint32) * 0x01010101
    return ((wv >> (BITS * q)) & mask) * (s1.to(tl.uint32) & 0xFF)[:, None] + bias[:, None]


@triton.jit
def _expand_block(w_ptr, s_ptr, m_ptr, w8_ptr, N, N0, N1, KB, Kp, NG, pid_n, pid_c, BITS: tl.constexpr, G: tl.constexpr,
                  BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    """Rows [N0 + pid_n * BLOCK_N, +BLOCK_N) of chunks [pid_c * CHUNKS, +CHUNKS): ``w8[row - N0, chunk * KC + 32 q +
    j]`` = the int8 level of bit-plane q of byte j (past K, in the padded chunk: the last group's ``m``). Word-wise:
    bytes j..j+3 of a row are one 32-bit word of codes, and plane q's four levels one word, ``((w >> BITS*q) & mask)
    * s1 + (m + 128) * 0x01010101`` with each byte's sign bit flipped (the form bounds ``c * s1`` and the level + 128
    to a byte: nothing carries across bytes); a chunk's planes are joined so each row's ``KC`` bytes are one store."""
    P: tl.constexpr = 8 // BITS
    KW: tl.constexpr = 8 * P  # output words of one chunk and row
    offs_n = N0 + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N1
    rn = tl.where(n_mask, offs_n, N0)
    jw = tl.arange(0, 8)
    o = tl.arange(0, KW)
    w_rows = w_ptr.to(tl.pointer_type(tl.uint32)) + rn[:, None].to(tl.int64) * (KB // 4)
    out_rows = w8_ptr.to(tl.pointer_type(tl.uint32)) + (rn - N0)[:, None].to(tl.int64) * (Kp // 4)
    for cc in tl.static_range(CHUNKS):
        c = pid_c * CHUNKS + cc
        wv = tl.load(w_rows + c * 8 + jw[None, :])
        p0 = _plane_words(wv, s_ptr, m_ptr, rn, c, 0, N, NG, BITS, G)
        p1 = _plane_words(wv, s_ptr, m_ptr, rn, c, 1, N, NG, BITS, G)
        if P == 4:
            p2 = _plane_words(wv, s_ptr, m_ptr, rn, c, 2, N, NG, BITS, G)
            p3 = _plane_words(wv, s_ptr, m_ptr, rn, c, 3, N, NG, BITS, G)
            lv = tl.join(tl.join(p0, p1), tl.join(p2, p3))  # [n, j, b, a]: plane 2a + b
            lv = tl.reshape(tl.permute(lv, (0, 3, 2, 1)), (BLOCK_N, KW))
        else:
            lv = tl.reshape(tl.permute(tl.join(p0, p1), (0, 2, 1)), (BLOCK_N, KW))
        tl.store(out_rows + c * KW + o[None, :], lv ^ 0x80808080, mask=n_mask[:, None])


@triton.jit
def _expand_kernel(w_ptr, s_ptr, m_ptr, w8_ptr, N, N0, N1, KB, Kp, NG, BITS: tl.constexpr, G: tl.constexpr,
                   BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    """Program (n, c): :func:`_expand_block` of row block n and chunk group c."""
    _expand_block(w_ptr, s_ptr, m_ptr, w8_ptr, N, N0, N1, KB, Kp, NG, tl.program_id(0), tl.program_id(1), BITS, G,
                  BLOCK_N, CHUNKS)  # fmt: skip


@triton.jit
def _prepass_kernel(x_ptr, amax_ptr, xq_ptr, sx_ptr, M, K, w_ptr, s_ptr, m_ptr, w8_ptr, N, N0, N1, KB, Kp, NG, CGROUPS,
                    SLICE, BLOCK_KX: tl.constexpr, BLOCK_AMAX: tl.constexpr, HAS_AMAX: tl.constexpr,
                    BITS: tl.constexpr, G: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):  # fmt: skip
    """The activation pass and the first row chunk's expansion in one launch: programs [0, M) quantize a token row
    each (:func:`~.activation.quant_row_slice`), the rest expand a block of rows x chunks each (:func:`_expand_block`),
    side by side on the GPU instead of two launches one after the other; the same codes and levels bit for bit."""
    pid = tl.program_id(0)
    if pid < M:
        quant_row_slice(x_ptr, amax_ptr, xq_ptr, sx_ptr, sx_ptr, pid.to(tl.int64), 0, K, Kp, SLICE, BLOCK_KX, False,
                        BLOCK_AMAX, HAS_AMAX)  # fmt: skip
    else:
        e = pid - M
        _expand_block(w_ptr, s_ptr, m_ptr, w8_ptr, N, N0, N1, KB, Kp, NG, e // CGROUPS, e % CGROUPS, BITS, G, BLOCK_N,
                      CHUNKS)  # fmt: skip


@triton.jit
def _int8_gemm_kernel(xq_ptr, sx_ptr, w8_ptr, s0_ptr, b_ptr, y_ptr, M, N, Kp, stride_ym, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of ``y = (xq @ w8^T) * sx * s0 (+ bias)``, int32 over the whole K
    (``Kp`` a multiple of BLOCK_K; both operands K-contiguous)."""
    pid = tl.program_id(0)
    offs_m, offs_n, m_mask, n_mask, rm, rn = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k = tl.arange(0, BLOCK_K)
    a_ptrs = xq_ptr + rm[:, None].to(tl.int64) * Kp + k[None, :]
    b_ptrs = w8_ptr + rn[:, None].to(tl.int64) * Kp + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for _ in range(0, Kp, BLOCK_K):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    out = acc.to(tl.float32) * tl.load(sx_ptr + rm)[:, None] * tl.load(s0_ptr + rn)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn).to(tl.float32)[None, :]
    offs = offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptr + offs, out.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def space(M: int) -> list[dict]:
    """The configs the tuner times for ``M`` tokens (prompts only; the Gluon GEMM's where it runs)."""
    if path(M) != "gemm":
        return []
    return SPACE + (WS_SPACE if torch.cuda.is_available() and gluon_gemm.usable(torch.device("cuda")) else [])


def config_usable(cfg: dict, device: torch.device) -> bool:
    """Whether ``cfg`` runs on ``device``: a ``WS=1`` config only where the Gluon GEMM does (a shipped or cached one
    elsewhere is passed over for the tuner or the heuristic)."""
    return not cfg.get("WS") or gluon_gemm.usable(device)


def heuristic(M: int, N: int, K: int, bits: int, device: torch.device) -> dict:
    """The untuned default: 128 x 128 x 128 tiles of 8 warps."""
    return dict(SPACE[0])


def _chunk_groups(Kp: int, bits: int) -> tuple[int, int]:
    """``(chunks a program, programs along K)`` of the expansion: ``EXPAND_CHUNKS`` where they divide the chunks."""
    chunks = Kp // triton_chunk(bits)
    per = EXPAND_CHUNKS if chunks % EXPAND_CHUNKS == 0 else 1
    return per, chunks // per


def expand_levels(weight: PackedLowBit, n0: int = 0, n1: Optional[int] = None,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The int8 levels ``[n1 - n0, Kp]`` of the weight's rows ``[n0, n1)`` (default all; K-contiguous; the padded k
    past K hold the last group's ``m``), into ``out``'s first rows where given."""
    N, bits = weight.out_features, weight.bits
    n1 = N if n1 is None else n1
    Kp = weight.qweight.shape[1] * (8 // bits)
    if not 0 <= n0 < n1 <= N:
        raise ValueError(f"expand_levels: rows [{n0}, {n1}) are not a range of the weight's {N} rows")
    if out is not None and (out.dtype != torch.int8 or not out.is_contiguous() or out.shape[0] < n1 - n0
                            or out.shape[1:] != (Kp,)):
        raise ValueError(f"expand_levels: out must be a contiguous int8 [>= {n1 - n0}, {Kp}] tensor, not "
                         f"{out.dtype} {tuple(out.shape)}")
    w8 = torch.empty(n1 - n0, Kp, dtype=torch.int8, device=weight.qweight.device) if out is None else out
    per, groups = _chunk_groups(Kp, bits)
    _expand_kernel[(triton.cdiv(n1 - n0, EXPAND_ROWS), groups)](
        weight.qweight, weight.scales, weight.zeros, w8, N, n0, n1, weight.qweight.shape[1], Kp, weight.scales.shape[0],
        BITS=bits, G=weight.group_size, BLOCK_N=EXPAND_ROWS, CHUNKS=per, num_warps=4,
    )  # fmt: skip
    return w8


def _prepass(x2: torch.Tensor, Kp: int, act_amax: Optional[torch.Tensor], weight: PackedLowBit, n1: int,
             w8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(xq, sx)``: :func:`~.activation.quantize_rows` of ``x2`` (M > 16: one program a row), and the levels of the
    weight's rows [0, n1) into ``w8``, in one launch."""
    M, K = x2.shape
    xq = torch.empty(M, Kp, dtype=torch.int8, device=x2.device)
    sx = torch.empty(M, dtype=torch.float32, device=x2.device)
    bkx, nw = row_program(Kp)  # quantize_rows' programs for M > 16
    per, cgroups = _chunk_groups(Kp, weight.bits)
    _prepass_kernel[(M + triton.cdiv(n1, EXPAND_ROWS) * cgroups,)](
        x2, sx if act_amax is None else act_amax, xq, sx, M, K, weight.qweight, weight.scales, weight.zeros, w8,
        weight.out_features, 0, n1, weight.qweight.shape[1], Kp, weight.scales.shape[0], cgroups,
        bkx * triton.cdiv(Kp, bkx), BLOCK_KX=bkx, BLOCK_AMAX=bkx, HAS_AMAX=act_amax is not None, BITS=weight.bits,
        G=weight.group_size, BLOCK_N=EXPAND_ROWS, CHUNKS=per, num_warps=nw,
    )  # fmt: skip
    return xq, sx


def launch(x2: torch.Tensor, weight: PackedLowBit, bias: Optional[torch.Tensor], y: torch.Tensor, cfg: dict,
           act_amax: Optional[torch.Tensor] = None) -> None:  # fmt: skip
    """The activation pass, then per chunk of rows the expansion and the int8 GEMM for ``x2 [M, K]``, writing
    ``y [M, N]``."""
    check(x2, weight, cfg)
    M = x2.shape[0]
    N = weight.out_features
    Kp = weight.qweight.shape[1] * (8 // weight.bits)
    bk, chunks = cfg["BLOCK_K"], cfg.get("ROW_CHUNKS", 1)
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{NAME}: config ROW_CHUNKS={chunks!r} must be a positive int (1: the whole weight at once)")
    if Kp % bk:
        raise ValueError(f"{NAME}: BLOCK_K={bk} does not divide the padded K={Kp}; use 64")
    if cfg.get("WS", 0) not in (0, 1):
        raise ValueError(f"{NAME}: config WS={cfg['WS']!r} must be 0 (the Triton GEMM) or 1 (the Gluon one)")
    if cfg.get("WS"):
        gluon_gemm.check(x2.device, cfg)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    rows = -(-N // (chunks * bn)) * bn  # each chunk's rows: whole output tiles
    w8 = torch.empty(min(rows, N), Kp, dtype=torch.int8, device=x2.device)
    xq, sx = _prepass(x2, Kp, act_amax, weight, min(rows, N), w8)
    s0 = weight.supers.reshape(-1)
    for n0 in range(0, N, rows):
        n1 = min(n0 + rows, N)
        if n0:  # the first chunk's levels came with the activation pass
            expand_levels(weight, n0, n1, w8)
        if cfg.get("WS"):
            gluon_gemm.launch_gemm(xq, sx, w8, n1 - n0, s0[n0:], None if bias is None else bias[n0:], y[:, n0:], cfg)
            continue
        _int8_gemm_kernel[(triton.cdiv(M, bm) * triton.cdiv(n1 - n0, bn),)](
            xq, sx, w8, s0[n0:], s0 if bias is None else bias[n0:], y[:, n0:], M, n1 - n0, Kp, y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.get("GROUP_M", 8),
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )  # fmt: skip
