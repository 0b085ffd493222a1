"""Triton segment-KV attention (CUDA, Intel XPU; ``TRITON_INTERPRET=1`` on CPU for tests).

Same contract as :func:`aipc_kernels.decoder.segment_contract.reference_segment_sdpa`. One program per
(batch entry, KV head, split of the positions): it loads the queries of all ``E`` beams x ``G`` heads x
``Lq`` queries of that KV head as one tile, reads each prompt K/V block once for the whole tile
(``tl.dot``), then each beam's response rows through the path table, with one online softmax over
both segments. Splits (flash-decoding) give a small batch enough programs to fill the GPU; their
partial softmax states are merged by a second small kernel. fp32 inputs: exact fp32 products;
fp16/bf16: tensor-core products with fp32 accumulation (probabilities rounded to the K/V dtype for
the value product, as flash attention does); softmax state always fp32.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from aipc_kernels.decoder.segment_contract import check_args, kernel_mask

MAX_TILE_ROWS = 128  # E * G * Lq rows per KV head that one program holds

# Only tl builtins and the helpers below are used in the kernels: triton's own @jit helpers (tl.zeros,
# tl.max, tl.sum) are decorated when triton is imported, so they would not run under an interpreter
# switched on later (tests set TRITON_INTERPRET=1 only around this module's import).


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


@triton.jit
def _scores(q, k, IS_FP32: tl.constexpr):
    if IS_FP32:  # exact fp32 products
        return tl.dot(q, tl.trans(k), input_precision="ieee")
    return tl.dot(q, tl.trans(k))  # fp16 / bf16 tensor cores, fp32 accumulation


@triton.jit
def _online_update(s, v, m_i, l_i, acc, IS_FP32: tl.constexpr):
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
    dead = m_new == float("-inf")
    alpha = tl.where(dead, 1.0, tl.exp(m_i - m_new))
    p = tl.where(dead[:, None], 0.0, tl.exp(s - m_new[:, None]))
    l_i = l_i * alpha + tl.reduce(p, 1, _add_combine)
    if IS_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:  # probabilities in the K/V dtype, as flash attention does
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _masked_scores(s, pos, col_ok, row_ok, MASK, mask_row_off, L, Lq, l_r, HAS_MASK: tl.constexpr,
                   CAUSAL: tl.constexpr):  # fmt: skip
    ok = row_ok[:, None] & col_ok[None, :]
    if HAS_MASK:
        s = s + tl.load(MASK + mask_row_off[:, None] + pos[None, :], mask=ok, other=0.0)
    if CAUSAL:
        ok = ok & (pos[None, :] <= (L - Lq + l_r)[:, None])
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _segment_sdpa_kernel(
    Q, q_sn, q_sh, q_sl, PK, PV, RK, RV, PATH, MASK, m_sn, m_sh, m_sl,
    ACC, M_OUT, L_OUT,
    N, E, G, Lq, Hkv, D, Np, L, chunk, scale,
    HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, IS_FP32: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    bk = tl.program_id(0)
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    b = bk // Hkv
    kvh = bk % Hkv
    r = tl.arange(0, BLOCK_R)
    R = E * G * Lq
    row_ok = r < R
    l_r = r % Lq
    g_r = (r // Lq) % G
    e_r = r // (Lq * G)
    n_r = b * E + e_r
    h_r = kvh * G + g_r
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + (n_r * q_sn + h_r * q_sh + l_r * q_sl)[:, None] + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * scale  # fmt: skip
    q = q.to(PK.dtype.element_ty)
    mask_row_off = n_r * m_sn + h_r * m_sh + l_r * m_sl
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_R], 0.0, tl.float32)
    acc = tl.full([BLOCK_R, BLOCK_D], 0.0, tl.float32)
    j0 = split * chunk
    j1 = tl.minimum(j0 + chunk, L)
    cols = tl.arange(0, BLOCK_N)

    # prompt segment: each K/V block is read once for all rows (beams x heads x queries)
    p_end = tl.minimum(j1, Np)
    for start in range(j0, p_end, BLOCK_N):
        pos = start + cols
        col_ok = pos < p_end
        off = ((b * Np + pos) * Hkv + kvh) * D
        kv_ok = col_ok[:, None] & d_ok[None, :]
        k = tl.load(PK + off[:, None] + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(PV + off[:, None] + d[None, :], mask=kv_ok, other=0.0)
        s = _scores(q, k, IS_FP32)
        s = _masked_scores(s, pos, col_ok, row_ok, MASK, mask_row_off, L, Lq, l_r, HAS_MASK, CAUSAL)
        m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, IS_FP32)

    # response segment: per beam, rows picked by the path table
    t0 = tl.maximum(j0, Np) - Np
    t1 = j1 - Np
    for e in range(0, E):
        n = b * E + e
        beam_rows = row_ok & (e_r == e)
        for start in range(t0, t1, BLOCK_N):
            t = start + cols
            col_ok = t < t1
            phys = tl.load(PATH + t * N + n, mask=col_ok, other=0)
            off = ((t * N + phys) * Hkv + kvh) * D
            kv_ok = col_ok[:, None] & d_ok[None, :]
            k = tl.load(RK + off[:, None] + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(RV + off[:, None] + d[None, :], mask=kv_ok, other=0.0)
            s = _scores(q, k, IS_FP32)
            s = _masked_scores(s, Np + t, col_ok, beam_rows, MASK, mask_row_off, L, Lq, l_r, HAS_MASK, CAUSAL)
            m_i, l_i, acc = _online_update(s, v, m_i, l_i, acc, IS_FP32)

    base = bk * nsplit + split
    tl.store(M_OUT + base * BLOCK_R + r, m_i)
    tl.store(L_OUT + base * BLOCK_R + r, l_i)
    tl.store(ACC + (base * BLOCK_R + r)[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit
def _merge_kernel(ACC, M_IN, L_IN, OUT, nsplit, E, G, Lq, Hkv, Hq, D,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    """One program per (batch entry, KV head, row): merges the splits and writes out[n, l, h, :]."""
    bk = tl.program_id(0)
    r = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < nsplit
    idx = (bk * nsplit + s) * BLOCK_R + r
    m = tl.load(M_IN + idx, mask=s_ok, other=float("-inf"))
    lsum = tl.load(L_IN + idx, mask=s_ok, other=0.0)
    big = tl.reduce(m, 0, _max_combine)
    w = tl.where(m == float("-inf"), 0.0, tl.exp(m - big))
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(ACC + idx[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    num = tl.reduce(acc * w[:, None], 0, _add_combine)
    den = tl.reduce(lsum * w, 0, _add_combine)
    out = tl.where(den > 0, num / den, 0.0)
    b = bk // Hkv
    kvh = bk % Hkv
    l = r % Lq
    g = (r // Lq) % G
    e = r // (Lq * G)
    n = b * E + e
    h = kvh * G + g
    tl.store(OUT + ((n * Lq + l) * Hq + h) * D + d, out, mask=d < D)


def _num_splits(units: int, L: int, block_n: int, device: torch.device) -> int:
    if device.type == "cuda":
        target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    elif device.type == "xpu":
        target = 2 * torch.xpu.get_device_properties(device).gpu_subslice_count
    else:  # interpreter: a few splits, so the tests cover the merge
        target = 3 * units
    most = triton.cdiv(L, block_n)
    return max(1, min(most, triton.cdiv(target, units)))


def segment_sdpa(
    query: torch.Tensor,
    prompt_key: torch.Tensor,
    prompt_value: torch.Tensor,
    response_key: torch.Tensor,
    response_value: torch.Tensor,
    path: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    is_causal: bool = False,
    num_splits: Optional[int] = None,
    block_n: int = 64,
    num_warps: int = 4,
    out_poison: bool = False,
) -> torch.Tensor:
    """Triton segment attention ``[N, Lq, Hq, D]`` in the query's dtype (see the module docstring).
    ``out_poison`` fills every intermediate and the output with NaN first (tests)."""
    d = check_args(query, prompt_key, prompt_value, response_key, response_value, path, attn_mask)
    R = d.E * (d.Hq // d.Hkv) * d.Lq
    if R > MAX_TILE_ROWS:
        raise ValueError(
            f"triton segment_sdpa: {d.E} beams x {d.Hq // d.Hkv} query heads per KV head x {d.Lq} queries = {R} rows "
            f"per KV head exceed the kernel's tile of {MAX_TILE_ROWS}; lower num_beams"
        )
    scale = d.D**-0.5 if scale is None else float(scale)
    dev = query.device
    if query.stride(-1) != 1:
        query = query.contiguous()
    pk, pv, rk, rv, path = (t.contiguous() for t in (prompt_key, prompt_value, response_key, response_value, path))
    if d.Np == 0:  # pointers must be valid even when unused
        pk = pv = query.new_zeros(1)
    if d.Nr == 0:
        rk = rv = query.new_zeros(1)
        path = torch.zeros(1, dtype=torch.int32, device=dev)
    mask, ms = query.new_zeros(1, dtype=torch.float32), (0, 0, 0)
    if attn_mask is not None:
        mask, ms = kernel_mask(attn_mask, d)
    BLOCK_R = max(16, triton.next_power_of_2(R))
    BLOCK_D = max(16, triton.next_power_of_2(d.D))
    units = d.B * d.Hkv
    nsplit = num_splits or _num_splits(units, d.L, block_n, dev)
    chunk = triton.cdiv(triton.cdiv(d.L, nsplit), block_n) * block_n
    nsplit = triton.cdiv(d.L, chunk)
    fill = torch.full if out_poison else (lambda shape, _v, **kw: torch.empty(shape, **kw))
    acc = fill((units * nsplit * BLOCK_R, BLOCK_D), float("nan"), dtype=torch.float32, device=dev)
    m = fill((units * nsplit * BLOCK_R,), float("nan"), dtype=torch.float32, device=dev)
    lsum = fill((units * nsplit * BLOCK_R,), float("nan"), dtype=torch.float32, device=dev)
    _segment_sdpa_kernel[(units, nsplit)](
        query, query.stride(0), query.stride(1), query.stride(2), pk, pv, rk, rv, path, mask, *ms,
        acc, m, lsum, d.N, d.E, d.Hq // d.Hkv, d.Lq, d.Hkv, d.D, d.Np, d.L, chunk, scale,
        HAS_MASK=attn_mask is not None, CAUSAL=bool(is_causal), IS_FP32=query.dtype == torch.float32,
        BLOCK_R=BLOCK_R, BLOCK_N=block_n, BLOCK_D=BLOCK_D, num_warps=num_warps,
    )  # fmt: skip
    out = fill((d.N, d.Lq, d.Hq, d.D), float("nan"), dtype=torch.float32, device=dev)
    _merge_kernel[(units, R)](
        acc, m, lsum, out, nsplit, d.E, d.Hq // d.Hkv, d.Lq, d.Hkv, d.Hq, d.D,
        BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, BLOCK_S=max(2, triton.next_power_of_2(nsplit)),
    )  # fmt: skip
    return out if query.dtype == torch.float32 else out.to(query.dtype)
