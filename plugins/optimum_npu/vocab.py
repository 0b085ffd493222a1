"""Embedding and LM-head IRs with weights quantized while streamed from the checkpoint.

The vocabulary matrices are the largest tensors of a small LM (128256 x 2048 for Llama-3.2-1B:
0.5 GiB in bf16, 1 GiB in f32). Handing them to NNCF whole costs several f32 copies at once.
Here they are read from the safetensors ``ROWS`` rows at a time and quantized by NNCF's own
``do_integer_quantization`` (same modes, scales and zero points as ``nncf.compress_weights``),
so the export never holds more than the compressed matrix plus one block; the IR carries the
same decompression subgraph NNCF emits (``Constant -> Convert -> [Subtract] -> Multiply``), which
the OpenVINO plugins fuse into their compressed Gather / FullyConnected kernels.
"""
from __future__ import annotations

from typing import Any

import numpy as np

ROWS = 4096  # rows quantized at a time (4096 x 2048 f32 = 32 MiB)


def quantize_rows(read_rows, shape: tuple[int, int],
                  quant: dict[str, Any]) -> dict[str, np.ndarray]:
    """Quantizes a ``[rows, cols]`` matrix block by block; ``read_rows(a, b)`` returns rows
    ``[a, b)`` as a float tensor. Returns ``weight`` (int8/uint8 values, or int4/uint4 values
    unpacked in int8/uint8 and shaped ``[rows, cols // group, group]``), ``scale`` (float16,
    ``[rows, 1]`` or ``[rows, groups, 1]``) and for asymmetric modes ``zero_point``."""
    from nncf import CompressWeightsMode
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.weight_lowering import (
        do_integer_quantization)
    from nncf.tensor import Tensor

    rows, cols = shape
    mode = CompressWeightsMode(quant["mode"])
    group = quant["group_size"] if quant["weight_format"] == "int4" else -1
    if group != -1 and cols % group:
        raise ValueError(f"group_size={group} does not divide the hidden size {cols}; choose a "
                         "group_size that does, or -1 (per channel)")
    config = WeightCompressionConfig(mode=mode, group_size=group)
    wshape = (rows, cols) if group == -1 else (rows, cols // group, group)
    sshape = (rows, 1) if group == -1 else (rows, cols // group, 1)
    asym = mode in (CompressWeightsMode.INT8_ASYM, CompressWeightsMode.INT4_ASYM)
    out = dict(weight=np.empty(wshape, np.uint8 if asym else np.int8),
               scale=np.empty(sshape, np.float16))
    if asym:
        out["zero_point"] = np.empty(sshape, np.uint8)
    for start in range(0, rows, ROWS):
        stop = min(start + ROWS, rows)
        block = np.ascontiguousarray(read_rows(start, stop).float().numpy())
        cw = do_integer_quantization(Tensor(block), config, reduction_axes=(1,))
        out["weight"][start:stop] = _numpy(cw.tensor).reshape((stop - start, *wshape[1:]))
        out["scale"][start:stop] = _numpy(cw.scale).reshape((stop - start, *sshape[1:]))
        if asym:
            out["zero_point"][start:stop] = _numpy(cw.zero_point).reshape(
                (stop - start, *sshape[1:]))
        del block, cw
    return out


def _numpy(t) -> np.ndarray:
    return np.asarray(t.as_numpy_tensor().data if hasattr(t, "as_numpy_tensor") else t.data)


def _constant(values: np.ndarray, four_bit: bool, signed: bool):
    """An OpenVINO Constant of ``values`` (int4/uint4 packed two per byte, low nibble first)."""
    import openvino as ov
    from openvino import opset13 as ops

    if not four_bit:
        return ops.constant(values, shared_memory=True)
    flat = values.reshape(-1).view(np.uint8) & 0x0F
    if flat.size % 2:
        flat = np.concatenate([flat, np.zeros(1, np.uint8)])
    packed = flat[0::2] | (flat[1::2] << 4)
    tensor = ov.Tensor(ov.Type.i4 if signed else ov.Type.u4, ov.Shape(list(values.shape)))
    np.copyto(tensor.data.reshape(-1), packed)
    return ops.constant(tensor)


def dequantized(q: dict[str, np.ndarray], quant: dict[str, Any], shape: tuple[int, int]):
    """The float32 ``[rows, cols]`` output of NNCF's decompression subgraph over ``q``."""
    from openvino import Type
    from openvino import opset13 as ops

    four_bit = quant["weight_format"] == "int4"
    asym = "zero_point" in q
    w = ops.convert(_constant(q["weight"], four_bit, not asym), Type.f16)
    if asym:
        w = ops.subtract(w, ops.convert(_constant(q["zero_point"], four_bit, False), Type.f16))
    w = ops.multiply(w, ops.constant(q["scale"], shared_memory=True))
    if q["weight"].ndim == 3:
        w = ops.reshape(w, ops.constant(np.array(shape, np.int64)), special_zero=False)
    return ops.convert(w, Type.f32)


def embedding_model(q: dict[str, np.ndarray], quant: dict[str, Any], shape: tuple[int, int],
                    block: int, scale: float | None, names: tuple[str, str]):
    """``token [1, block] i64 -> x [1, block, hidden] f32``: a Gather from the dequantized table
    (times the architecture's embedding scale, if any)."""
    import openvino as ov
    from openvino import opset13 as ops

    token = ops.parameter([1, block], ov.Type.i64, name=names[0])
    x = ops.gather(dequantized(q, quant, shape), token, ops.constant(np.int64(0)))
    if scale is not None:
        x = ops.multiply(x, ops.constant(np.float32(scale)))
    return ov.Model([ops.result(x)], [token], "npu_embed")


def append_lm_head(normed_model, q: dict[str, np.ndarray], quant: dict[str, Any],
                   shape: tuple[int, int], softcap: float | None):
    """``normed_model`` (``x -> final-norm(x)`` [1, 1, hidden]) extended by the LM head
    (``MatMul`` with the dequantized ``[vocab, hidden]`` matrix, then any logit soft cap)."""
    import openvino as ov
    from openvino import opset13 as ops

    normed = normed_model.output(0).get_node().input_value(0)
    logits = ops.matmul(normed, dequantized(q, quant, shape), False, True)
    if softcap:
        cap = ops.constant(np.float32(softcap))
        logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
    return ov.Model([ops.result(logits)], list(normed_model.get_parameters()), "npu_head")
