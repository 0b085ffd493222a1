"""``aipc::lowbit_linear`` checks every operand before a kernel runs, and the native entry point re-checks
what it indexes with.

The fuzz is a bounded property test: valid calls (every code book, layout, dtype, group and activation
group) get random shape/dtype/layout mutations; each call either raises a ValueError that names the
mutated operand first (``lowbit_linear: <operand> ...``) or matches the float64 reference of what its
operands mean. It runs in a child process, so a crash in native code fails the test instead of the run.
"""
from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from aipc_kernels.core import native
from aipc_kernels.lowbit import ops, packing
from aipc_kernels.lowbit.formats import CODEBOOKS
from aipc_kernels.lowbit.quantizers import quantize_rtn

FUZZ_EXAMPLES = 200
FUZZ_SECONDS = 60  # the child's wall-clock bound (it takes ~15 s on a shared 2-core machine)
TOL = {torch.float32: 2e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
PACK = {
    packing.CPU_LAYOUT: packing.pack_for_cpu,
    "canonical": packing.as_canonical_packed,
    packing.TRITON_LAYOUT: packing.pack_for_triton,
}
LAYOUTS = list(PACK)
ISAS = native.supported_isas() if native.available() else []  # the native kernels' ISAs this CPU runs
ARGS = ("x", "qweight", "scales", "zeros", "bias", "layout", "codebook", "group_size", "out_features", "act_group")


def _valid_call(draw) -> dict:
    """The op's arguments for a random valid call (CPU tensors)."""
    codebook = draw(st.sampled_from(sorted(CODEBOOKS)))
    K = draw(st.sampled_from([64, 128, 192, 256]))
    group = draw(st.sampled_from([g for g in (32, 64, 128) if K % g == 0] + [K]))
    N = draw(st.integers(1, 40))
    M = draw(st.sampled_from([0, 1, 2, 3, 5]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    scale_dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    dense = torch.randn(N, K, generator=g)
    w = quantize_rtn(dense, codebook, -1 if group == K else group, scale_dtype=scale_dtype)
    p = PACK[draw(st.sampled_from(LAYOUTS))](w)
    x_dtype = draw(st.sampled_from(sorted(TOL, key=str)))
    bias = torch.randn(N, generator=g).to(draw(st.sampled_from([torch.float32, x_dtype]))) if draw(st.booleans()) else None
    act_group = draw(st.sampled_from([0] + [a for a in range(group, K + 1, group) if K % a == 0]))
    return dict(x=torch.randn(M, K, generator=g).to(x_dtype), qweight=p.qweight, scales=p.scales, zeros=p.zeros,
                bias=bias, layout=p.layout, codebook=p.codebook, group_size=p.group_size, out_features=N,
                act_group=act_group, M=M, K=K, G=p.group_size, dense=dense, packed=p)  # fmt: skip


def _other(draw, options, current):
    return draw(st.sampled_from([o for o in options if o != current] or list(options)))


# Each mutation changes one or two arguments and returns the operands an error may name first (a change
# can leave the call valid: then the result must match the reference of the new operands).
def _m_zeros_dropped(draw, a):
    a["zeros"] = None
    return {"zeros"}


def _m_zeros_added(draw, a):
    a["zeros"] = a["scales"].clone()
    return {"zeros"}


def _m_scales_16(draw, a):
    a["scales"] = a["scales"].flatten()[:16]
    return {"scales"}


def _m_scales_other_group(draw, a):
    K, p = a["K"], a["packed"]
    G = draw(st.sampled_from([g for g in (32, 64, 128) if K % g == 0] + [K]))
    a["scales"] = PACK[p.layout](quantize_rtn(a["dense"], p.codebook, -1 if G == K else G, p.scales.dtype)).scales
    return {"scales"}


def _m_scales_dtype(draw, a):
    a["scales"] = a["scales"].to(draw(st.sampled_from([torch.float64, torch.float32, torch.int8, torch.bfloat16])))
    # drawn twice, the last dtype may be a valid one that the stored zeros no longer match: then zeros is named
    return {"scales"} if a["zeros"] is None else {"scales", "zeros"}


def _m_scales_transposed(draw, a):
    a["scales"] = a["scales"].transpose(-1, -2)
    return {"scales"}


def _m_zeros_dtype(draw, a):
    if a["zeros"] is not None:
        a["zeros"] = a["zeros"].to(draw(st.sampled_from([torch.float64, torch.float16, torch.bfloat16])))
    return {"zeros"}


def _m_zeros_shape(draw, a):
    if a["zeros"] is not None:
        a["zeros"] = a["zeros"].flatten()[: max(1, a["zeros"].numel() // 2)]
    return {"zeros"}


def _m_qweight_dtype(draw, a):
    q = a["qweight"]
    a["qweight"] = draw(st.sampled_from([q.float(), q.view(torch.int8), q.to(torch.int32)]))
    return {"qweight"}


def _m_qweight_shape(draw, a):
    q = a["qweight"]
    a["qweight"] = draw(st.sampled_from([q.reshape(-1), q[..., 1:], q[1:], q.unsqueeze(0), torch.cat([q, q])]))
    return {"qweight"}


def _m_bias(draw, a):
    N = a["out_features"]
    a["bias"] = draw(st.sampled_from([torch.randn(1), torch.randn(N + 1), torch.randn(1, N),
                                      torch.ones(N, dtype=torch.int32), torch.ones(N, dtype=torch.bool)]))  # fmt: skip
    return {"bias"}


def _m_x_dtype(draw, a):
    a["x"] = a["x"].to(draw(st.sampled_from([torch.float64, torch.int32, torch.uint8])))
    return {"x"}


def _m_x_shape(draw, a):
    M, K, dt = a["M"], a["K"], a["x"].dtype
    a["x"] = draw(st.sampled_from([torch.randn(M, K + 32).to(dt), torch.randn(M, K - 32).to(dt), torch.randn(M, K + 1).to(dt),
                                   torch.randn(M, 0).to(dt), torch.tensor(1.0).to(dt), torch.randn(2, M, K).to(dt)]))  # fmt: skip
    return {"x", "qweight", "scales", "group_size", "act_group"}


def _m_strided(draw, a):
    """Same shapes, non-contiguous storage: always valid."""
    name = draw(st.sampled_from(["x", "qweight", "scales", "zeros", "bias"]))
    t = a[name]
    if t is not None and t.dim() >= 1:
        a[name] = torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]
    return set()


def _m_group_size(draw, a):
    K = a["K"]
    a["group_size"] = _other(draw, [32, 48, 64, 128, K, 2 * K, 16, 0, -1], a["group_size"])
    return {"group_size", "act_group", "scales"}


def _m_act_group(draw, a):
    K, G = a["K"], a["G"]
    a["act_group"] = draw(st.sampled_from([-5, -1, 16, 48, G // 2, G, 2 * G, K, 2 * K, K + G]))
    return {"act_group"}


def _m_out_features(draw, a):
    N = a["out_features"]
    a["out_features"] = draw(st.sampled_from([N - 1, N + 1, N + 16, 0, -3]))
    return {"out_features", "qweight", "scales", "zeros", "bias"}


def _m_codebook(draw, a):
    a["codebook"] = _other(draw, sorted(CODEBOOKS) + ["int3"], a["codebook"])
    return {"codebook", "qweight", "scales", "zeros"}


def _m_layout(draw, a):
    a["layout"] = _other(draw, LAYOUTS + ["cpu_vnni32"], a["layout"])
    return {"layout", "qweight", "scales", "zeros"}


MUTATIONS = [v for k, v in sorted(globals().items()) if k.startswith("_m_")]


def _expected(a: dict) -> tuple[torch.Tensor, float]:
    """The float64 reference of a valid call and its tolerance: the native kernel's exact math (int8
    activations) for the CPU layout, the weight-only product for the reference path."""
    x = a["x"]
    assert x.dtype in TOL, f"the op accepted x of dtype {x.dtype}"
    K = x.shape[-1]
    w = packing.to_canonical(packing.PackedLowBit(a["layout"], a["qweight"], a["scales"], a["zeros"], a["codebook"],
                                                  a["group_size"], a["out_features"], K))  # fmt: skip
    bias = a["bias"]
    if a["layout"] == packing.CPU_LAYOUT and native.available():
        ref = ops.reference_linear_w8(x, w, bias, a["act_group"])
    else:
        ref = x.double() @ w.dequantize(torch.float64).T
        ref = ref if bias is None else ref + bias.double()
    return ref, TOL[x.dtype]


def _check_call(a: dict, allowed: set[str]) -> None:
    try:
        y = torch.ops.aipc.lowbit_linear(*(a[k] for k in ARGS))
    except ValueError as e:
        m = re.match(r"lowbit_linear: (\w+)", str(e))
        assert m and m.group(1) in allowed, f"error names {m and m.group(1)!r}, expected one of {allowed}: {e}"
        return
    ref, tol = _expected(a)  # accepted: the operands form a valid call, so the reference computes it
    assert y.dtype == a["x"].dtype and y.shape == ref.shape, (y.dtype, y.shape, ref.shape)
    scale = ref.abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol * scale + 1e-6)


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))  # fmt: skip
@given(st.data())
def lowbit_linear_property(data):
    """One fuzz example: a valid call, 0-2 mutations, the op on a random ISA of this CPU."""
    a = _valid_call(data.draw)
    allowed: set[str] = set()
    for mutate in data.draw(st.lists(st.sampled_from(MUTATIONS), max_size=2)):
        allowed |= mutate(data.draw, a)
    if ISAS:
        native.set_isa(data.draw(st.sampled_from(ISAS)))
    try:
        _check_call(a, allowed)
    finally:
        if ISAS:
            native.set_isa(native.best_isa())


def test_lowbit_linear_operand_fuzz():
    start = time.monotonic()
    try:
        child = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=FUZZ_SECONDS)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the fuzz ran past {FUZZ_SECONDS} s:\n{(e.stdout or '')[-3000:]}{(e.stderr or '')[-3000:]}")
    out = (child.stdout + child.stderr)[-6000:]
    assert child.returncode == 0, f"fuzz child exited with {child.returncode} (negative: killed by a signal):\n{out}"
    assert f"{FUZZ_EXAMPLES} examples passed" in child.stdout, out
    print(f"fuzz: {FUZZ_EXAMPLES} examples in {time.monotonic() - start:.1f} s")


# ------------------------------------------------------------------ the cases the issue found


def _affine_call(N=20, K=128, G=64, seed=0):
    w = quantize_rtn(torch.randn(N, K, generator=torch.Generator().manual_seed(seed)), "affine", G)
    p = packing.pack_for_cpu(w)
    return w, dict(x=torch.randn(2, K), qweight=p.qweight, scales=p.scales, zeros=p.zeros, bias=None,
                   layout=p.layout, codebook=p.codebook, group_size=p.group_size, out_features=N, act_group=0)  # fmt: skip


@pytest.mark.parametrize("case, change, named", [
    ("zeros None with affine", dict(zeros=None), "zeros"),
    ("16-element scales", dict(scales=torch.ones(16, dtype=torch.float16)), "scales"),
    ("scales of group 32", dict(scales=torch.ones(2, 4, 16, dtype=torch.float16)), "scales"),
    ("1-element bias", dict(bias=torch.ones(1)), "bias"),
    ("float32 qweight", dict(qweight=torch.zeros(2, 8, 16, 4)), "qweight"),
    ("float64 scales", dict(scales=torch.ones(2, 2, 16, dtype=torch.float64)), "scales"),
    ("act_group not a multiple of the group", dict(act_group=32), "act_group"),
    ("negative act_group", dict(act_group=-5), "act_group"),
    ("group_size -1", dict(group_size=-1), "group_size"),
    ("unknown code book", dict(codebook="int3"), "codebook"),
    ("zeros for a fixed code book", dict(codebook="int2"), "zeros"),
    ("float64 x", dict(x=torch.randn(2, 128, dtype=torch.float64)), "x"),
], ids=lambda v: v if isinstance(v, str) else "")  # fmt: skip
def test_bad_operand_is_refused_naming_it(case, change, named):
    _, a = _affine_call()
    a.update(change)
    with pytest.raises(ValueError, match=rf"^lowbit_linear: {named}\b"):
        torch.ops.aipc.lowbit_linear(*(a[k] for k in ARGS))


@pytest.mark.parametrize("layout", LAYOUTS)  # on CPU: the native kernel, or the reference for the others
@pytest.mark.parametrize("case, amax, act_group", [
    ("3 values for 2 tokens", torch.ones(3), 0),
    ("float64", torch.ones(2, dtype=torch.float64), 0),
    ("bfloat16", torch.ones(2, dtype=torch.bfloat16), 0),
    ("shape [2, 1]", torch.ones(2, 1), 0),
    ("with per-group activation scales", torch.ones(2), 64),
], ids=lambda v: v if isinstance(v, str) else "")  # fmt: skip
def test_bad_act_amax_is_refused_naming_it(layout, case, amax, act_group):
    w, a = _affine_call()
    p = PACK[layout](w)
    a.update(qweight=p.qweight, scales=p.scales, zeros=p.zeros, layout=p.layout, act_group=act_group)
    with pytest.raises(ValueError, match=r"^lowbit_linear: act_amax\b"):
        torch.ops.aipc.lowbit_linear(*(a[k] for k in ARGS), amax)


def test_act_amax_is_one_value_per_token():
    """``act_amax`` as ``[M]`` or as x's leading shape: the same call."""
    w, a = _affine_call()
    a["x"] = torch.randn(2, 3, 128)
    amax = a["x"].abs().amax(-1) * 3
    flat = torch.ops.aipc.lowbit_linear(*(a[k] for k in ARGS), amax.reshape(-1))
    assert torch.equal(torch.ops.aipc.lowbit_linear(*(a[k] for k in ARGS), amax), flat)
    assert not torch.equal(torch.ops.aipc.lowbit_linear(*(a[k] for k in ARGS)), flat)  # it is used
    assert torch.equal(torch.ops.aipc.lowbit_linear(*(a[k] for k in ARGS), amax.t().contiguous().t()), flat)  # strided


@pytest.mark.skipif(not native.available(), reason="native library not built")
def test_native_entry_checks_act_amax():
    """A caller of the native entry that skipped the op: act_amax's dtype and length (Python side), and
    act_amax with per-group activation scales (the C entry's own status)."""
    _, a = _affine_call()
    x, y = a["x"], torch.empty(2, 20)
    args = (y, x, a["qweight"], a["scales"], a["zeros"], None, 2, 64, 1.0, math.nan)
    for bad in (torch.ones(2, dtype=torch.float64), torch.ones(3)):
        with pytest.raises(ValueError, match=r"^act_amax of shape"):
            native.lowbit_linear_into(*args, 128, bad)
    amax = torch.ones(2)
    with pytest.raises(RuntimeError, match=r"act_amax .* needs per-token activation scales .*act_group=64"):
        native.lowbit_linear_into(*args, 64, amax)
    v = native.lowbit_linear_args(*args, 64, amax)
    assert native.library().aipc_lowbit_linear_v(v.buffer_info()[0]) == -12
    native.lowbit_linear_into(*args, 128, amax)  # per token: runs


@pytest.mark.skipif(not native.available(), reason="native library not built")
def test_native_entry_rechecks_what_it_indexes():
    """The C entry point's own checks, through the packed argument vector (a caller that skipped the op)."""
    _, a = _affine_call()
    x, y = a["x"], torch.empty(2, 20)
    with pytest.raises(RuntimeError, match="zeros missing"):  # affine (zero point NaN) without zeros
        native.lowbit_linear_into(y, x, a["qweight"], a["scales"], None, None, 2, 64, 1.0, math.nan, 128)
    with pytest.raises(RuntimeError, match="bad code book constants"):
        native.lowbit_linear_into(y, x, a["qweight"], a["scales"], a["zeros"], None, 2, 64, 0.0, 0.0, 128)
    lib = native.library()
    for index, value, status in ((0, 0, -9), (4, 0, -9), (7, 0, -9), (14, 0, -9), (16, -1, -10), (16, 1 << 20, -10)):
        v = native.lowbit_linear_args(y, x, a["qweight"], a["scales"], a["zeros"], None, 2, 64, 1.0, math.nan, 128)
        v[index] = value  # x, qweight, scales, y NULL; nthreads out of range
        assert lib.aipc_lowbit_linear_v(v.buffer_info()[0]) == status, (index, value)
        assert native.status_message(status) != native.status_message(1)  # a worded error, not "unknown status"
    v = native.lowbit_linear_args(y, x, a["qweight"], a["scales"], a["zeros"], None, 2, 64, 1.0, math.nan, 128)
    assert lib.aipc_lowbit_linear_v(v.buffer_info()[0]) == 0  # the same vector, valid: runs


if __name__ == "__main__":  # the fuzz child (see test_lowbit_linear_operand_fuzz)
    lowbit_linear_property()
    print(f"{FUZZ_EXAMPLES} examples passed")
