"""``aipc::segment_sdpa`` against a float64 reference: random odd shapes, GQA, masks, causal queries,
float32/bfloat16/float16, every CPU instruction set, the op's dispatch, its fake kernel, and Triton
(interpreted on CPU) where installed. Outputs are poisoned with NaN before the kernel writes them."""
from __future__ import annotations

import os

import pytest
import torch

from aipc_kernels.core import native
from aipc_kernels.decoder import segment_attention as sa

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# (B, E, Hq, Hkv, Lq, D, Np, Nr, cap)
SHAPES = [
    (1, 4, 12, 4, 1, 64, 77, 13, 16),  # beam search decode, GQA 3
    (2, 3, 6, 2, 1, 40, 33, 5, 7),  # odd head dim, two prompts
    (3, 2, 4, 4, 3, 33, 9, 21, 32),  # multi-token step, MHA, response longer than prompt
    (1, 1, 8, 2, 5, 64, 300, 0, 0),  # prompt only, chunked across threads
    (2, 1, 2, 1, 1, 16, 0, 11, 11),  # response only
    (1, 8, 4, 1, 1, 128, 600, 40, 48),  # wide beam, long prompt (split into chunks)
    (2, 4, 16, 2, 3, 32, 70, 9, 12),  # 96 rows per kv head: two row tiles, each with both kv heads
]


def _case(B, E, Hq, Hkv, Lq, D, Np, Nr, cap, dtype, mask_kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    N = B * E

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q = r(N, Lq, Hq, D).transpose(1, 2)  # strided, as transformers passes it
    pk, pv = r(B, Np, Hkv, D), r(B, Np, Hkv, D)
    rk, rv = r(cap, N, Hkv, D), r(cap, N, Hkv, D)
    # a resolved beam table: each row's token t comes from a row of its own prompt
    path = (torch.arange(N) // E * E)[None, :] + torch.randint(0, E, (Nr, N), generator=g)
    path = path.to(torch.int32)
    mask = None
    L = Np + Nr
    if mask_kind == "bool":
        mask = torch.rand(N, 1, Lq, L, generator=g) > 0.3
        mask[..., -1] = True
    elif mask_kind == "float-heads":
        mask = torch.randn(1, Hq, Lq, L, generator=g)
        mask[..., : L // 3] = float("-inf")  # a left-padding-like block
    elif mask_kind == "left-pad":
        keep = torch.ones(N, L, dtype=torch.bool)
        keep[::2, : min(5, Np)] = False
        mask = keep[:, None, None, :].expand(N, 1, Lq, L)
    return q, pk, pv, rk, rv, path, mask


def _reference(args, scale, causal):
    return sa.reference_segment_sdpa(*args, scale=scale, is_causal=causal, compute_dtype=torch.float64)


def _check(got, ref, dtype):
    assert got.shape == ref.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), ref.double(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.fixture(params=["scalar", "avx2", "avx512_vnni"])
def isa(request):
    if not sa.native_available():
        pytest.skip("native library not built")
    if native.ISAS[request.param] > native.ISAS[native.best_isa()]:
        pytest.skip(f"{request.param} not supported by this CPU")
    before = native.get_isa()
    native.set_isa(request.param)
    yield request.param
    native.set_isa(before)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mask_kind", [None, "bool", "float-heads", "left-pad"])
def test_native_matches_reference(isa, shape, dtype, mask_kind):
    args = _case(*shape, dtype, mask_kind, seed=hash((shape, mask_kind)) % 1000)
    N, Hq, Lq, D = args[0].shape
    for causal in (False, True):
        out = torch.full((N, Lq, Hq, D), float("nan"))
        got = sa.native_segment_sdpa(*args, scale=0.3, is_causal=causal, out=out)
        assert got.dtype == dtype
        _check(got, _reference(args, 0.3, causal), dtype)


@pytest.mark.parametrize("threads", [1, 3])
def test_native_thread_counts(threads):
    if not sa.native_available():
        pytest.skip("native library not built")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        args = _case(1, 2, 4, 2, 1, 32, 1000, 30, 32, torch.float32, "bool")  # several chunks per row
        _check(sa.native_segment_sdpa(*args, scale=0.2), _reference(args, 0.2, False), torch.float32)
    finally:
        torch.set_num_threads(before)


def test_fully_masked_rows_are_zero():
    args = list(_case(1, 2, 2, 1, 2, 16, 7, 3, 4, torch.float32, "bool"))
    args[6] = torch.zeros_like(args[6])
    args[6][0] = True
    ref = _reference(args, 0.25, False)
    assert (ref[1] == 0).all()
    got = sa.segment_sdpa(*args, scale=0.25)
    _check(got, ref, torch.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask_kind", [None, "left-pad"])
def test_op_dispatch_matches_reference(shape, mask_kind):
    """The custom op on CPU (native kernel, or PyTorch SDPA for the prompt-only prefill)."""
    args = _case(*shape, torch.float32, mask_kind, seed=7)
    for causal in (False, True):
        got = torch.ops.aipc.segment_sdpa(*args, 0.125, causal)
        _check(got, _reference(args, 0.125, causal), torch.float32)


def test_prefill_with_padding_rows():
    """Prompt-only prefill with left padding: pad queries see nothing (zeros, not NaN)."""
    B, L, H, D = 2, 9, 4, 16
    q = torch.randn(B, H, L, D)
    pk, pv = torch.randn(B, L, 2, D), torch.randn(B, L, 2, D)
    keep = torch.ones(B, L, dtype=torch.bool)
    keep[1, :4] = False
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    mask = keep[:, None, None, :] & causal[None, None]
    empty = pk.new_empty(0, B, 2, D)
    args = (q, pk, pv, empty, empty, torch.empty(0, B, dtype=torch.int32), mask)
    got = torch.ops.aipc.segment_sdpa(*args, 0.25, False)
    _check(got, _reference(args, 0.25, False), torch.float32)
    assert (got[1, :4] == 0).all()


def test_fake_kernel_and_schema():
    args = _case(1, 2, 4, 2, 1, 16, 5, 3, 4, torch.float32, "bool")
    torch.library.opcheck(torch.ops.aipc.segment_sdpa.default, (*args, 0.25, False),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_clear_errors():
    q, pk, pv, rk, rv, path, _ = _case(1, 2, 4, 2, 1, 16, 5, 3, 4, torch.float32, None)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        sa.segment_sdpa(q[:, :3], pk, pv, rk, rv, path)
    with pytest.raises(ValueError, match="multiple of the prompts"):
        sa.segment_sdpa(q[:1], pk.expand(2, -1, -1, -1), pv.expand(2, -1, -1, -1), rk, rv, path)
    with pytest.raises(ValueError, match="int32"):
        sa.segment_sdpa(q, pk, pv, rk, rv, path.long())
    with pytest.raises(ValueError, match="dtype torch.float64 is not supported"):
        sa.segment_sdpa(q.double(), pk, pv, rk, rv, path)
    with pytest.raises(ValueError, match="prompt_key dtype"):
        sa.segment_sdpa(q, pk.half(), pv, rk, rv, path)
    with pytest.raises(ValueError, match="attn_mask must be 4-D"):
        sa.segment_sdpa(q, pk, pv, rk, rv, path, torch.ones(2, 8, dtype=torch.bool))
    if sa.native_available():
        bad = path.clone()
        bad[0, 0] = 99
        with pytest.raises(RuntimeError, match="path entry out of range"):
            sa.native_segment_sdpa(q, pk, pv, rk, rv, bad)


# (B, E, Hq, Hkv, Lq, D, Np, Nr, cap): a decode step, and a longer one that 3 threads split into chunks
NAN_SHAPES = [(1, 2, 4, 2, 1, 16, 40, 6, 8), (1, 2, 4, 2, 2, 32, 300, 20, 24)]
NAN_CASES = ["query", "query_inf", "scale", "prompt_key", "prompt_value", "response_key", "response_value", "mask",
             "masked_value", "future_key", "future_value"]  # fmt: skip


def _poison(args, where, scale):
    """``args`` of :func:`_case` (float-heads mask: the first L // 3 positions masked for every row, so
    whole blocks no row sees) with one NaN (or Inf) put at ``where``; returns (args, scale, is_causal)."""
    q, pk, pv, rk, rv, path, mask = (None if t is None else t.clone() for t in args)
    nan, L = float("nan"), mask.shape[-1]
    causal = where.startswith("future")
    if where == "query":
        q[0, 1, 0, 3] = nan
    elif where == "query_inf":
        q[1, 2, -1, 0] = float("inf")
    elif where == "scale":
        scale = nan
    elif where == "prompt_key":
        pk[0, L // 2, 1, 2] = nan
    elif where == "prompt_value":
        pv[0, L // 2, 0, 5] = nan
    elif where in ("response_key", "response_value"):
        t = rk if where == "response_key" else rv
        t[1, int(path[1, 1]), 1, 0] = nan  # row 1's second response token (row 0's too if its path meets it)
    elif where == "mask":
        mask[0, 3, 0, L - 2] = nan
    elif where == "masked_value":
        pv[0, 2, 1, 1] = nan  # position 2: masked for every row, in a block no row sees (0 * NaN in the reference)
    elif where == "future_key":  # the last position: after every query but the last under the causal rule
        rk[path.shape[0] - 1, :, 0, 0] = nan
    elif where == "future_value":  # the reference still gives NaN there (0 * NaN)
        rv[path.shape[0] - 1, :, 1, 0] = nan
    return (q, pk, pv, rk, rv, path, mask), scale, causal


@pytest.mark.parametrize("shape", NAN_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("where", NAN_CASES)
def test_nan_and_inf_propagate_as_in_the_reference(isa, shape, dtype, where):
    """NaN (or Inf) in the query, a key, a value, the scale or the mask gives NaN exactly where the float64
    reference does, and the same values elsewhere, on every ISA, split into chunks (3 threads) or not."""
    args, scale, causal = _poison(_case(*shape, dtype, "float-heads", seed=4), where, 0.3)
    ref = _reference(args, scale, causal)
    assert torch.isnan(ref).any()  # each case poisons something the reference sees
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        got = sa.native_segment_sdpa(*args, scale=scale, is_causal=causal)
    finally:
        torch.set_num_threads(before)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan), f"NaN at {torch.isnan(got).sum()} outputs, reference {nan.sum()}"
    torch.testing.assert_close(got[~nan].double(), ref[~nan].double(), atol=TOL[dtype], rtol=TOL[dtype])


def test_zero_sizes_and_foreign_devices_are_refused():
    """A head dim of 0 (ZeroDivisionError before), no heads, no queries: a ValueError naming the size, from
    the op and the reference alike; so is an index table or mask on another device than the query."""
    q, pk, pv, rk, rv, path, _ = _case(1, 2, 4, 2, 1, 16, 5, 3, 4, torch.float32, None)
    d0 = (q[..., :0], pk[..., :0], pv[..., :0], rk[..., :0], rv[..., :0], path)
    with pytest.raises(ValueError, match=r"query head dim D is 0"):
        sa.segment_sdpa(*d0)
    with pytest.raises(ValueError, match=r"query head dim D is 0"):
        sa.reference_segment_sdpa(*d0)
    with pytest.raises(ValueError, match=r"query heads Hq is 0"):
        sa.segment_sdpa(q[:, :0], pk, pv, rk, rv, path, scale=0.25)
    with pytest.raises(ValueError, match=r"query length Lq is 0"):
        sa.segment_sdpa(q[:, :, :0], pk, pv, rk, rv, path)
    with pytest.raises(ValueError, match=r"path is on meta"):
        sa.reference_segment_sdpa(q, pk, pv, rk, rv, path.to("meta"))
    with pytest.raises(ValueError, match=r"attn_mask is on meta"):
        sa.reference_segment_sdpa(q, pk, pv, rk, rv, path, torch.ones(4, 1, 1, 8, dtype=torch.bool, device="meta"))


@pytest.fixture(scope="module")
def triton_kernel():
    """The Triton kernel module: compiled on a CUDA machine, else imported under TRITON_INTERPRET=1
    (read when the kernels are decorated, so set only around the import)."""
    pytest.importorskip("triton")
    import importlib
    import sys

    name = "aipc_kernels.gpu.triton.segment_sdpa"
    if torch.cuda.is_available():
        return importlib.import_module(name)
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = saved


# small: the interpreter runs every program in Python (the GPU run adds SHAPES)
TRITON_SHAPES = [(1, 2, 6, 2, 1, 24, 19, 5, 8), (2, 2, 2, 1, 2, 16, 7, 3, 4), (1, 1, 4, 4, 1, 16, 0, 6, 8)]
GPU_SHAPES = TRITON_SHAPES + (SHAPES if torch.cuda.is_available() else [])


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_triton(triton_kernel, shape, dtype):
    """The Triton kernel: interpreted on CPU tensors here, compiled on a GPU (same test)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    args = _case(*shape, dtype, "left-pad", seed=3)
    dev_args = [None if a is None else a.to(device) for a in args]
    for causal in (False, True):
        got = triton_kernel.segment_sdpa(*dev_args, scale=0.3, is_causal=causal, out_poison=True)
        _check(got.cpu(), _reference(args, 0.3, causal), dtype)
