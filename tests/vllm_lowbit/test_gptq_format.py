"""``aipc_kernels.checkpoints.gptq`` against vLLM's own GPTQ / AWQ code: tensors quantized and packed by
vLLM's helpers (``quantize_weights``, ``gptq_pack``, ``awq_pack``, ``pack_cols``: the published
layouts), read back by vLLM's unpacking (``tests.helpers.gptq_checkpoint.vllm_dequantize``),
and the re-laid-out weight must dequantize to exactly the same float32 matrix, for every variant;
then the native W4A8 op on it; then every bad input, refused naming the tensor or key."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from aipc_kernels.checkpoints import gptq as gf  # noqa: E402
from aipc_kernels.lowbit.formats import LowBitWeight  # noqa: E402
from tests.helpers.gptq_checkpoint import awq_config, gptq_config, quantize_linear, vllm_dequantize  # noqa: E402

#: (method, group_size, sym, checkpoint_format, desc_act)
VARIANTS = {
    "gptq-sym-g128": ("gptq", 128, True, "gptq", False),
    "gptq-sym-g64-v2": ("gptq", 64, True, "gptq_v2", False),
    "gptq-sym-row": ("gptq", -1, True, "gptq", False),
    "gptq-asym-g32": ("gptq", 32, False, "gptq", False),
    "gptq-asym-g64-actorder": ("gptq", 64, False, "gptq", True),
    "gptq-asym-g128-v2": ("gptq", 128, False, "gptq_v2", False),
    "gptq-asym-row": ("gptq", -1, False, "gptq", False),
    "awq-g32": ("awq", 32, False, "gptq", False),
    "awq-g64": ("awq", 64, False, "gptq", False),
    "awq-g128": ("awq", 128, False, "gptq", False),
}


def _case(variant: str, N: int = 104, K: int = 384, seed: int = 0):
    """(quantization_config, checkpoint tensors, source weight) of one linear ``[N, K]``."""
    method, G, sym, fmt, desc_act = VARIANTS[variant]
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[: N // 4] += 0.03  # groups with an offset: zero points away from 8
    config = gptq_config(G, sym, desc_act, fmt) if method == "gptq" else awq_config(G)[0]
    return config, quantize_linear(w, method, G, sym, fmt), w


def _read(config, tensors, name="model.layers.0.mlp.down_proj", k_offset=0) -> LowBitWeight:
    spec, _ = gf.parse_quantization_config(config)
    return gf.read_linear(spec, tensors, name, k_offset)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_relayout_equals_vllm_dequantization(variant):
    """Bit-exact: the canonical weight's float32 dequantization equals vLLM's reading of the tensors;
    the scales are the checkpoint's fp16 values (no re-quantization); ``int4`` exactly when every
    zero point is 8 (sym), else ``affine4``."""
    config, tensors, w = _case(variant)
    lw = _read(config, tensors)
    ref = vllm_dequantize(config, tensors)
    assert torch.equal(lw.dequantize(), ref)
    assert lw.codebook == ("int4" if config.get("sym") else "affine4")
    assert lw.scales.dtype == torch.float16 and torch.equal(lw.scales, tensors["scales"].t())
    assert lw.group_size == (384 if config["group_size"] == -1 else config["group_size"])
    assert (ref - w).abs().max() <= 0.1 * w.abs().max()  # a 4-bit quantization of w, not noise


def test_bf16_scales_stay_bf16():
    config, tensors, _ = _case("awq-g64")
    tensors["scales"] = tensors["scales"].to(torch.bfloat16)
    lw = _read(config, tensors)
    assert lw.scales.dtype == lw.zeros.dtype == torch.bfloat16
    assert torch.equal(lw.dequantize(), vllm_dequantize(config, tensors))


@pytest.mark.parametrize("variant", ["gptq-asym-g64-actorder", "gptq-sym-row", "awq-g32"])
def test_tensor_parallel_slices(variant):
    """A row-parallel slice (K halves, the rank's g_idx with its offset) and a column-parallel slice
    (N halves) read into the matching slices of the whole weight. Whole-row groups stay whole-row on
    a K slice: every rank gets the row's scale (vLLM replicates it)."""
    config, t, _ = _case(variant, N=128, K=512)
    whole = _read(config, t).dequantize()
    gptq = config["quant_method"] == "gptq"
    rows_per_group = 1 if config["group_size"] == -1 else 256 // config["group_size"]
    for rank in (0, 1):
        kq = slice(rank * 256 // 8, (rank + 1) * 256 // 8) if gptq else slice(rank * 256, (rank + 1) * 256)
        kg = slice(0, 1) if config["group_size"] == -1 else slice(rank * rows_per_group, (rank + 1) * rows_per_group)
        part = {"qweight": t["qweight"][kq], "qzeros": t["qzeros"][kg], "scales": t["scales"][kg]}
        if gptq:
            part["g_idx"] = t["g_idx"][rank * 256 : (rank + 1) * 256]
        assert torch.equal(_read(config, part, k_offset=rank * 256).dequantize(), whole[:, rank * 256 : (rank + 1) * 256])
        n8 = slice(rank * 8, (rank + 1) * 8)
        cols = {"qweight": t["qweight"][:, rank * 64 : (rank + 1) * 64] if gptq else t["qweight"][:, n8],
                "qzeros": t["qzeros"][:, n8], "scales": t["scales"][:, rank * 64 : (rank + 1) * 64]}  # fmt: skip
        if gptq:
            cols["g_idx"] = t["g_idx"]
        assert torch.equal(_read(config, cols).dequantize(), whole[rank * 64 : (rank + 1) * 64])


@pytest.mark.parametrize("variant", ["gptq-sym-g128", "gptq-asym-g32", "awq-g64"])
def test_native_op_on_the_relayout(variant):
    """The W4A8 op on the re-laid-out weight: the float32 product of the int8-rounded activations and
    vLLM's dequantized weight, up to float32 summation order."""
    from aipc_kernels.lowbit.ops import lowbit_linear
    from aipc_kernels.lowbit.packing import pack_for_cpu
    from aipc_kernels.lowbit.quantizers import quantize_activations

    config, tensors, _ = _case(variant)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(3))
    xq, s = quantize_activations(x)
    ref = (xq.float() * s) @ vllm_dequantize(config, tensors).t()
    got = lowbit_linear(x, pack_for_cpu(_read(config, tensors)))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_awq_order_and_v1_offset_are_the_formats():
    """The two conventions the reader depends on, on hand-built int32 words: AWQ's bits 4*j hold
    column AWQ_ORDER[j]; GPTQ v1 qzeros hold zero - 1."""
    word = torch.tensor([[0x87654321 - (1 << 32)]], dtype=torch.int32)  # nibble j holds j + 1 (the top one: the sign bit)
    assert gf.unpack_int32(word, 1).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert gf.unpack_int32(word, 1, gf.AWQ_ORDER).tolist() == [[1, 5, 2, 6, 3, 7, 4, 8]]
    assert gf.unpack_int32(word.t(), 0).flatten().tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    spec, _ = gf.parse_quantization_config(gptq_config(128, False))
    assert spec.zero_offset == 1 and gf.parse_quantization_config(gptq_config(128, False, False, "gptq_v2"))[0].zero_offset == 0


def test_ignored_config_keys_are_reported():
    _, ignored = gf.parse_quantization_config(gptq_config(128, True))
    assert ignored == ["damp_percent", "model_file_base_name", "model_name_or_path", "static_groups", "true_sequential"]
    spec, ignored = gf.parse_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64,
                                                  "zero_point": True, "version": "GEMM"})  # quant_config.json keys
    assert (spec.bits, spec.group_size, spec.version, ignored) == (4, 64, "gemm", [])


# ---------------------------------------------------------------------- bad inputs, named errors


@pytest.mark.parametrize("config, match", [
    ({"quant_method": "gptq", "bits": 8}, r"gptq quantization_config\.bits=8 is not supported; use one of 4 \(aipc-plugins "
                                          r"reads 4-bit GPTQ; serve this checkpoint without --quantization lowbit4"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 16}, r"gptq quantization_config\.group_size=16 is not supported"),
    ({"quant_method": "gptq", "sym": "true"}, r"gptq quantization_config\.sym='true' must be true or false"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, r"checkpoint_format='marlin' is not supported"),
    ({"quant_method": "gptq", "lm_head": True}, r"lm_head=True \(a quantized output projection"),
    ({"quant_method": "gptq", "dynamic": {"-:.*down": {}}}, r"dynamic=.* \(per-layer bits/group overrides\)"),
    ({"quant_method": "gptq", "checkpoint_format": "gptq", "format": "gptq_v2"}, r"format='gptq_v2' contradicts"),
    ({"quant_method": "awq", "version": "gemv"}, r"awq quantization_config\.version='gemv' is not supported"),
    ({"quant_method": "awq", "zero_point": False}, r"awq quantization_config\.zero_point=False is not supported"),
    ({"quant_method": "fp8"}, r"quant_method='fp8' is neither 'gptq' nor 'awq'"),
])  # fmt: skip
def test_config_errors_name_the_key(config, match):
    with pytest.raises(ValueError, match=match):
        gf.parse_quantization_config(config)


def test_group_not_dividing_k():
    config, t, _ = _case("gptq-sym-g128", K=384)
    t = {"qweight": t["qweight"][:40], "qzeros": t["qzeros"][:3], "scales": t["scales"][:3]}  # K = 320
    with pytest.raises(ValueError, match=r"gptq layer L: group_size=128 does not divide its in_features K=320"):
        _read(config, t, name="L")


@pytest.mark.parametrize("part, change, match", [
    ("scales", lambda t: t[:, :-8], r"checkpoint tensor L\.scales has shape \(3, 96\), expected \(3, 104\)"),
    ("scales", lambda t: t.float(), r"checkpoint tensor L\.scales has dtype torch\.float32, expected torch\.float16 or "
                                    r"torch\.bfloat16"),
    ("qzeros", lambda t: t[:2], r"checkpoint tensor L\.qzeros has shape \(2, 13\), expected \(3, 13\)"),
    ("qweight", lambda t: t.view(torch.uint8), r"checkpoint tensor L\.qweight has dtype torch\.uint8 and shape "
                                               r"\(48, 416\), expected a 2-D torch\.int32 tensor"),
    ("g_idx", lambda t: t[:-1], r"checkpoint tensor L\.g_idx has shape \(383,\), expected \(384,\)"),
    ("qzeros", None, r"checkpoint is missing tensor L\.qzeros"),
    ("scales", lambda t: t.masked_fill(t == t.max(), float("inf")), r"checkpoint tensor L\.scales holds NaN or Inf"),
])  # fmt: skip
def test_tensor_errors_name_the_tensor(part, change, match):
    config, t, _ = _case("gptq-sym-g128")
    t = dict(t)
    if change is None:
        del t[part]
    else:
        t[part] = change(t[part])
    with pytest.raises(ValueError, match=match):
        _read(config, t, name="L")


def test_act_order_g_idx_refused():
    """A real activation-order checkpoint (g_idx the groups of a permuted input order) is refused
    naming the tensor and the index; desc_act without g_idx too."""
    config, t, _ = _case("gptq-asym-g64-actorder")
    perm = torch.randperm(384, generator=torch.Generator().manual_seed(1))
    t = dict(t, g_idx=(perm // 64).to(torch.int32))
    k = int((t["g_idx"] != torch.arange(384) // 64).nonzero()[0, 0])
    with pytest.raises(ValueError, match=rf"GPTQ tensor L\.g_idx is an activation-order grouping \(g_idx\[{k}\]=.*"
                                         r"quantize with desc_act false, or desc_act true with static_groups true"):
        _read(config, t, name="L")
    del t["g_idx"]
    with pytest.raises(ValueError, match=r"checkpoint is missing tensor L\.g_idx, which desc_act true needs"):
        _read(config, t, name="L")


def test_sym_checkpoint_with_other_zero_points_refused():
    """``sym: true`` promises zero points of 8 (vLLM ignores qzeros then); tensors that say otherwise
    are refused rather than read one way or the other."""
    config, t, _ = _case("gptq-asym-g32")
    config = dict(config, sym=True)
    with pytest.raises(ValueError, match=r"checkpoint tensor L\.qzeros holds the zero point \d+ \(group \d+, column \d+\) "
                                         r"in a sym: true checkpoint"):
        _read(config, t, name="L")
