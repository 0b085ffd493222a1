"""``lowbit2`` checkpoints: writing them from a Hugging Face model directory (no vLLM needed).

:func:`convert_checkpoint` reads a bf16/fp16/fp32 safetensors checkpoint tensor by tensor, quantizes
every ``nn.Linear`` weight of the model (except ``lm_head``, embeddings and
``modules_to_not_convert``) with the shared quantizers, and writes ``X.qweight``/``X.scales``
(/``X.zeros``) in the canonical ``lowbit2`` format (:mod:`aipc_kernels.formats`) beside the
untouched tensors, plus ``quantization_config`` in config.json, so that ``vllm serve OUT`` loads it
without flags. A BitNet b1.58 checkpoint (transformers' ``quant_method: bitnet``, packed ternary
``bitlinear`` weights with a per-tensor ``weight_scale``) is imported losslessly into the
``ternary`` code book; any other quantized checkpoint is refused.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from aipc_kernels.atomic_output import RECORD_NAME, atomic_output_dir
from aipc_kernels.config_schema import parse
from aipc_kernels.formats import FORMAT_NAME, SCALE_DTYPES, LowBitWeight, pack_codes, save_lowbit
from aipc_kernels.hf_checkpoint import INDEX_NAME, HFCheckpoint, read_config
from aipc_kernels.modules import DEFAULT_SKIP
from aipc_kernels.quantizers import quantize_rows

from .grid_linears import GridLinears
from .options import API_NAMING, LowBit2Options, quantization_config_dict

SHARD_BYTES = 2 << 30
BITNET_VALUES_PER_BYTE = 4


# ---------------------------------------------------------------------- reading a checkpoint


def _linear_names(config: dict[str, Any], skip: tuple[str, ...]) -> set[str]:
    """Names of the model's ``nn.Linear`` modules (from the architecture, built on the meta device)."""
    import transformers
    from aipc_kernels.modules import linear_names

    cfg = dict(config)
    cfg.pop("quantization_config", None)
    hf_config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return set(linear_names(model, skip))


def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="tensor")
    except ImportError:  # pragma: no cover - tqdm comes with vLLM and transformers
        return None


class _ShardWriter:
    """Writes tensors and low-bit weights to ``model-0000i-of-0000n.safetensors`` shards + index."""

    def __init__(self, out: Path):
        self.out, self.shards, self.weights, self.extra, self.size = out, [], {}, {}, 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.extra[name] = t.contiguous()
        self._grow(t.numel() * t.element_size())

    def add_lowbit(self, prefix: str, w: LowBitWeight) -> None:
        self.weights[prefix] = w
        self._grow(w.nbytes())

    def _grow(self, n: int) -> None:
        self.size += n
        if self.size >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not (self.weights or self.extra):
            return
        path = self.out / f"part-{len(self.shards):05d}.safetensors"
        save_lowbit(str(path), self.weights, self.extra)
        names = list(self.extra) + [k for p, w in self.weights.items() for k in w.state_dict(p)]
        self.shards.append((path, names))
        self.weights, self.extra, self.size = {}, {}, 0

    def close(self) -> None:
        self._flush()
        n = len(self.shards)
        weight_map = {}
        for i, (path, names) in enumerate(self.shards):
            final = self.out / ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
            path.rename(final)
            weight_map.update({k: final.name for k in names})
        if n > 1:
            (self.out / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n"
            )


# ---------------------------------------------------------------------- BitNet import


def unpack_bitnet(packed: torch.Tensor) -> torch.Tensor:
    """BitNet b1.58 packed ternary weights (transformers' ``bitlinear`` layout: uint8 ``[N/4, K]``,
    value ``i`` of row block ``i`` in bits ``2i..2i+1``, stored as ``v + 1``) -> codes ``v + 1`` ``[N, K]``."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"BitNet packed weight must be a 2-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}")
    shifts = torch.arange(BITNET_VALUES_PER_BYTE, dtype=torch.uint8) * 2
    codes = (packed.unsqueeze(0) >> shifts.view(-1, 1, 1)) & 3  # [4, N/4, K]: block i holds rows i*N/4...
    return codes.reshape(-1, packed.shape[1])


def _bitnet_weight(name: str, packed: torch.Tensor, weight_scale: torch.Tensor, group_size: int,
                   scale_dtype: torch.dtype) -> LowBitWeight:  # fmt: skip
    """One BitNet linear -> ``ternary`` lowbit2: ``W = (c - 1) / weight_scale`` exactly in the codes,
    the scale ``1 / weight_scale`` rounded once to ``scale_dtype``."""
    codes = unpack_bitnet(packed)
    if (codes > 2).any():
        raise ValueError(f"BitNet tensor {name}.weight holds the code 3, which is not ternary; the checkpoint is corrupt")
    if weight_scale.numel() != 1:
        raise ValueError(f"BitNet tensor {name}.weight_scale has {weight_scale.numel()} elements; expected one per tensor")
    N, K = codes.shape
    G = K if group_size == -1 else group_size
    if K % G:
        raise ValueError(f"group_size={group_size} does not divide in_features K={K} of {name}; pick one that does, or -1")
    scale = (1.0 / weight_scale.double()).to(scale_dtype)
    return LowBitWeight(pack_codes(codes, 2), scale.expand(N, K // G).contiguous(), None, "ternary", G, K, name=name)


# ---------------------------------------------------------------------- conversion


def _copy_side_files(src: Path, out: Path) -> None:
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".pt")) and f.name not in (
            INDEX_NAME, "config.json", "aipc_tiny_model.json", RECORD_NAME,
        ):  # fmt: skip
            shutil.copy2(f, out / f.name)


def convert_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    codebook: str = "affine",
    group_size: int = 64,
    quantizer: str = "optimized",
    scale_dtype: str = "float16",
    modules_to_not_convert: Optional[list[str]] = None,
    act_group: int = 0,
    progress: bool = True,
    log: Callable[[str], None] = print,
    detect_grid: bool = True,
) -> Path:
    """Writes the ``lowbit2`` checkpoint of ``model_dir`` to ``out_dir`` and returns ``out_dir``.

    Unquantized checkpoints are quantized with ``quantizer`` (``optimized`` or ``rtn``); a BitNet
    b1.58 checkpoint is imported into the ``ternary`` code book (``codebook`` must then be
    ``ternary``); any other ``quantization_config`` is refused. ``act_group`` is recorded for the
    server (0: one int8 activation scale per token; else per that many K). ``detect_grid``: linears
    whose weights already lie on a binary/ternary/2-bit grid are written exactly
    (:mod:`vllm_lowbit.grid_linears`), the others with ``quantizer``."""
    parse(LowBit2Options, dict(codebook=codebook, group_size=group_size, quantizer=quantizer, scale_dtype=scale_dtype,
                               act_group=act_group, modules_to_not_convert=modules_to_not_convert or [],
                               detect_grid=detect_grid), API_NAMING)  # fmt: skip
    src, out = Path(model_dir), Path(out_dir)
    config = read_config(src)
    qcfg = config.get("quantization_config")
    source = None
    if qcfg is not None:
        method = qcfg.get("quant_method")
        if method == "bitnet":
            if qcfg.get("linear_class", "bitlinear") != "bitlinear" or qcfg.get("use_rms_norm", False):
                raise ValueError(
                    f"{src}: BitNet checkpoint with linear_class={qcfg.get('linear_class')!r}, "
                    f"use_rms_norm={qcfg.get('use_rms_norm', False)} cannot be imported; only packed ternary "
                    f"'bitlinear' weights without a per-linear RMSNorm map onto lowbit2"
                )
            if codebook != "ternary":
                raise ValueError(f"{src} is a BitNet b1.58 (ternary) checkpoint: pass codebook='ternary' (--codebook ternary)")
            source = "bitnet"
        elif method == FORMAT_NAME:
            raise ValueError(f"{src} is already a {FORMAT_NAME} checkpoint; serve it directly")
        else:
            raise ValueError(
                f"{src}: quantization_config.quant_method={method!r} cannot be converted to {FORMAT_NAME}; "
                f"supported inputs are unquantized (bf16/fp16/fp32) checkpoints and BitNet b1.58 ('bitnet') "
                f"packed ternary checkpoints"
            )
    skip = tuple(DEFAULT_SKIP) + tuple(modules_to_not_convert or ())
    linears = _linear_names(config, skip)
    checkpoint = HFCheckpoint(src)
    grids = GridLinears(linears, lambda p, t: _quantize(p, t, codebook, group_size, quantizer, scale_dtype),
                        detect_grid and source is None, group_size, act_group, SCALE_DTYPES[scale_dtype])  # fmt: skip

    with atomic_output_dir(out, what=f"{FORMAT_NAME} checkpoint", redo="convert again", param="out_dir") as part:
        n_quant = _write_checkpoint(part, checkpoint, config, linears, source, codebook, group_size,
                                    quantizer, scale_dtype, modules_to_not_convert, act_group, progress, grids)
    log(f"wrote {n_quant} {FORMAT_NAME} linears ({codebook}, group {group_size}) to {out}")
    if grids.summary():
        log(grids.summary())
    return out


def _quantize(prefix: str, t: torch.Tensor, codebook: str, group_size: int, quantizer: str, scale_dtype: str) -> LowBitWeight:
    """One float linear weight quantized with the shared quantizer; errors name the tensor."""
    try:
        return quantize_rows(t, codebook, group_size, quantizer, SCALE_DTYPES[scale_dtype], name=prefix)
    except ValueError as e:
        raise ValueError(f"cannot quantize {prefix}.weight: {e}; or pass it in modules_to_not_convert") from None


def _write_checkpoint(
    out: Path, checkpoint: HFCheckpoint, config: dict[str, Any], linears: set[str], source: Optional[str],
    codebook: str, group_size: int, quantizer: str, scale_dtype: str,
    modules_to_not_convert: Optional[list[str]], act_group: int, progress: bool, grids: GridLinears,
) -> int:
    """Writes the checkpoint into the staging directory ``out``, config.json last (a directory
    without it is never taken for a model); returns the number of quantized linears."""
    sdtype = SCALE_DTYPES[scale_dtype]
    writer = _ShardWriter(out)
    bar = _progress(len(checkpoint), f"lowbit2 {codebook} g{group_size}") if progress else None
    pending_scale: dict[str, torch.Tensor] = {}
    pending_packed: dict[str, torch.Tensor] = {}
    n_quant = 0
    for name, t in checkpoint.tensors():
        prefix, _, leaf = name.rpartition(".")
        if source == "bitnet" and prefix in linears and leaf in ("weight", "weight_scale"):
            (pending_packed if leaf == "weight" else pending_scale)[prefix] = t
            if prefix in pending_packed and prefix in pending_scale:
                w = _bitnet_weight(prefix, pending_packed.pop(prefix), pending_scale.pop(prefix), group_size, sdtype)
                writer.add_lowbit(prefix, w)
                n_quant += 1
        elif source is None and leaf == "weight" and prefix in linears:
            if t.dim() != 2 or not t.is_floating_point():
                raise ValueError(f"tensor {name} has dtype {t.dtype} and shape {tuple(t.shape)}; expected a float matrix")
            for p, w in grids.add(prefix, t):  # grid layers exactly (merged siblings together), else quantized
                writer.add_lowbit(p, w)
                n_quant += 1
        else:
            writer.add(name, t)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    for p, w in grids.finish():
        writer.add_lowbit(p, w)
        n_quant += 1
    leftover = sorted(set(pending_packed) | set(pending_scale))
    if leftover:
        raise ValueError(f"BitNet checkpoint: {leftover[0]} lacks its weight or weight_scale tensor")
    if n_quant == 0:
        raise ValueError(
            f"{checkpoint.directory}: no linear weight was found to quantize (linear modules: {sorted(linears)[:5]}...)"
        )
    writer.close()

    _copy_side_files(checkpoint.directory, out)
    config["quantization_config"] = quantization_config_dict(
        codebook, group_size, quantizer, scale_dtype, act_group,
        modules_to_not_convert=list(modules_to_not_convert or []), source=source, layer_formats=grids.layer_formats,
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return n_quant
