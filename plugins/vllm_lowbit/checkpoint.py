"""``lowbit2`` checkpoints: writing them from a Hugging Face model directory (no vLLM needed).

:func:`convert_checkpoint` reads a bf16/fp16/fp32 safetensors checkpoint tensor by tensor, quantizes
every ``nn.Linear`` weight of the model (except ``lm_head``, embeddings and
``modules_to_not_convert``) with the shared quantizers, and writes ``X.qweight``/``X.scales``
(/``X.zeros``) in the canonical ``lowbit2`` format (:mod:`aipc_kernels.lowbit.formats`) beside the
untouched tensors, plus ``quantization_config`` in config.json, so that ``vllm serve OUT`` loads it
without flags. A BitNet b1.58 checkpoint (transformers' ``quant_method: bitnet``: packed ternary
``bitlinear`` or ``autobitlinear`` weights with a per-tensor ``weight_scale``, or bf16 masters) is
imported into the ``ternary`` code book with the reader the server uses
(:mod:`aipc_kernels.checkpoints.bitnet`): the ternary codes exactly, each tensor's scale rounded once to
the scale dtype; any other quantized checkpoint is refused. ``vllm serve`` also serves BitNet
checkpoints as they are (the ``bitnet`` method of :mod:`vllm_lowbit.bitnet`): converting them is
only needed to store them in the ``lowbit2`` layout.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from aipc_kernels.core.atomic_output import RECORD_NAME, atomic_output_dir
from aipc_kernels.core.config_schema import parse
from aipc_kernels.checkpoints import bitnet as bf
from aipc_kernels.lowbit.formats import FORMAT_NAME, SCALE_DTYPES, LowBitWeight, fitting_group_size, save_lowbit
from aipc_kernels.core.hf_checkpoint import INDEX_NAME, HFCheckpoint, read_config
from aipc_kernels.lowbit.modules import DEFAULT_SKIP
from aipc_kernels.lowbit.quality_gate import ErrorReport, needs_opt_in, ptq_refusal, relative_error
from aipc_kernels.lowbit.progressive import quantize_layer

from .grid_linears import GridLinears
from .options import API_NAMING, LowBit2Options, quantization_config_dict

SHARD_BYTES = 2 << 30
CONVERTER = "python -m vllm_lowbit.quantize"
OPT_IN_HINT = "pass --allow-2bit-ptq (convert_checkpoint(..., allow_2bit_ptq=True))"


# ---------------------------------------------------------------------- reading a checkpoint


def _linear_names(config: dict[str, Any], skip: tuple[str, ...]) -> set[str]:
    """Names of the model's ``nn.Linear`` modules (from the architecture, built on the meta device)."""
    import transformers
    from aipc_kernels.lowbit.modules import linear_names

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


def _bitnet_spec(src: Path, qcfg: dict[str, Any], codebook: str) -> bf.BitNetQuantization:
    """The BitNet family of ``src`` (every family imports: packed ``bitlinear`` and ``autobitlinear``,
    and the bf16 masters), checked before any work."""
    spec, _ = bf.parse_quantization_config(qcfg)
    if codebook != "ternary":
        raise ValueError(f"{src} is a BitNet b1.58 (ternary) checkpoint: pass codebook='ternary' (--codebook ternary)")
    return spec


def _bitnet_weight(spec: bf.BitNetQuantization, name: str, tensors: dict[str, torch.Tensor], group_size: int,
                   scale_dtype: torch.dtype) -> tuple[LowBitWeight, torch.Tensor]:  # fmt: skip
    """One BitNet linear -> (its ``ternary`` lowbit2 weight, the source's own float weight): codes
    exact, the value of a 1 rounded once to ``scale_dtype``."""
    if spec.packed:
        values = bf.unpack_ternary(tensors["weight"], f"{name}.weight")
        one = bf.packed_scale(tensors["weight_scale"], spec.linear_class, f"{name}.weight_scale")
    else:
        values, one = bf.ternarize(tensors["weight"], bf.absmean_multiplier(tensors["weight"]))
    row_one = torch.full((values.shape[0],), one, dtype=torch.float32)
    w = bf.ternary_weight(values, row_one, name, scale_dtype, group_size)
    return w, values.double() * one


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
    verify: bool = False,
    log: Callable[[str], None] = print,
    detect_grid: bool = True,
    allow_2bit_ptq: bool = False,
) -> Path:
    """Writes the ``lowbit2`` checkpoint of ``model_dir`` to ``out_dir`` and returns ``out_dir``.

    Unquantized checkpoints are quantized with ``quantizer`` (``optimized`` or ``rtn``; ``progressive`` with
    ``codebook`` min2 / min4: the progressive two-level form, each layer's ``super_block`` in ``layer_formats``); a BitNet
    b1.58 checkpoint (packed ``bitlinear`` or ``autobitlinear``, or bf16 masters) is imported into
    the ``ternary`` code book (``codebook`` must then be ``ternary``): codes exact, each tensor's
    scale rounded once to ``scale_dtype``; any other ``quantization_config`` is refused.
    ``act_group`` is recorded for the server (0: one int8 activation scale per token; else per that
    many K). ``detect_grid``: linears whose weights already lie on a binary/ternary/2-bit grid are
    written exactly (:mod:`vllm_lowbit.grid_linears`), the others with ``quantizer``. ``verify``:
    logs the largest reconstruction error against the source's own weights. A linear on no grid is
    refused with a 1- or 2-bit ``codebook`` unless ``allow_2bit_ptq`` (:mod:`aipc_kernels.lowbit.quality_gate`);
    a ``group_size`` that does not divide a linear's K falls back to the largest one that does (recorded
    in ``layer_formats``), as on the server. The largest relative reconstruction error of the quantized
    linears is logged against the quality table's bounds."""
    parse(LowBit2Options, dict(codebook=codebook, group_size=group_size, quantizer=quantizer, scale_dtype=scale_dtype,
                               act_group=act_group, modules_to_not_convert=modules_to_not_convert or [],
                               detect_grid=detect_grid, allow_2bit_ptq=allow_2bit_ptq), API_NAMING)  # fmt: skip
    src, out = Path(model_dir), Path(out_dir)
    config = read_config(src)
    qcfg = config.get("quantization_config")
    bitnet = None
    if qcfg is not None:
        method = qcfg.get("quant_method")
        if method == bf.QUANT_METHOD:
            bitnet = _bitnet_spec(src, qcfg, codebook)
        elif method == FORMAT_NAME:
            raise ValueError(f"{src} is already a {FORMAT_NAME} checkpoint; serve it directly")
        else:
            raise ValueError(
                f"{src}: quantization_config.quant_method={method!r} cannot be converted to {FORMAT_NAME}; "
                f"supported inputs are unquantized (bf16/fp16/fp32) checkpoints and BitNet b1.58 ('bitnet') "
                f"checkpoints"
            )
    skip = tuple(DEFAULT_SKIP) + tuple(modules_to_not_convert or ())
    linears = _linear_names(config, skip)
    kept = list(modules_to_not_convert or [])
    if bitnet is not None:  # the BitNet checkpoint's own float linears stay float
        float_linears = sorted(n for n in linears if bf.not_converted(n, bitnet.skipped))
        linears -= set(float_linears)
        kept += float_linears
    if bitnet is None and not detect_grid and needs_opt_in(codebook) and not allow_2bit_ptq:
        raise ValueError(ptq_refusal(sorted(linears)[0] if linears else "(every linear)", codebook, CONVERTER, OPT_IN_HINT))
    checkpoint = HFCheckpoint(src)
    errors = ErrorReport()
    layer_formats: dict[str, dict[str, Any]] = {}  # each layer stored in a form other than the config's

    def quantize(prefix: str, t: torch.Tensor) -> LowBitWeight:
        if needs_opt_in(codebook) and not allow_2bit_ptq:
            raise ValueError(ptq_refusal(prefix, codebook, CONVERTER, OPT_IN_HINT))
        w = _quantize(prefix, t, codebook, group_size, quantizer, scale_dtype)
        if w.supers is not None:  # the progressive form: int8 group scales, its row scales per super-block
            layer_formats[prefix] = dict(codebook=codebook, group_size=w.group_size, scale_dtype="int8",
                                         super_block=w.super_block)  # fmt: skip
        elif group_size != -1 and w.group_size != group_size:
            layer_formats[prefix] = dict(codebook=codebook, group_size=w.group_size, scale_dtype=scale_dtype)
        errors.add(prefix, relative_error(t, w))
        return w

    grids = GridLinears(linears, quantize, detect_grid and bitnet is None, group_size, act_group,
                        SCALE_DTYPES[scale_dtype])  # fmt: skip

    with atomic_output_dir(out, what=f"{FORMAT_NAME} checkpoint", redo="convert again", param="out_dir") as part:
        n_quant, worst = _write_checkpoint(part, checkpoint, config, linears, bitnet, codebook, group_size,
                                           quantizer, scale_dtype, kept, act_group, progress, grids, verify, layer_formats)
    log(f"wrote {n_quant} {FORMAT_NAME} linears ({codebook}, group {group_size}) to {out}")
    group_fallbacks = {p: f for p, f in layer_formats.items() if f["group_size"] != group_size}
    if group_fallbacks:
        groups = sorted({v["group_size"] for v in group_fallbacks.values()})
        log(f"group_size={group_size} does not divide the in_features of {len(group_fallbacks)} linears (e.g. "
            f"{next(iter(group_fallbacks))}): they use group_size {groups} (quantization_config.layer_formats)")
    if errors.line(CONVERTER):
        log(errors.line(CONVERTER))
    if grids.summary():
        log(grids.summary())
    if worst is not None:
        log(f"verify: largest reconstruction error max|W - Wq| / max|W| = {worst[0]:.3g} ({worst[1]})")
    return out


def _quantize(prefix: str, t: torch.Tensor, codebook: str, group_size: int, quantizer: str, scale_dtype: str) -> LowBitWeight:
    """One float linear weight quantized with the shared quantizer (a group that does not divide its K
    falls back, :func:`~aipc_kernels.lowbit.formats.fitting_group_size`); errors name the tensor."""
    try:
        group = fitting_group_size(group_size, t.shape[1])
        return quantize_layer(t, codebook, group, quantizer, SCALE_DTYPES[scale_dtype], name=prefix)
    except ValueError as e:
        raise ValueError(f"cannot quantize {prefix}.weight: {e}; or pass it in modules_to_not_convert") from None


def _write_checkpoint(
    out: Path, checkpoint: HFCheckpoint, config: dict[str, Any], linears: set[str],
    bitnet: Optional[bf.BitNetQuantization], codebook: str, group_size: int, quantizer: str, scale_dtype: str,
    modules_to_not_convert: list[str], act_group: int, progress: bool, grids: GridLinears, verify: bool,
    layer_formats: dict[str, dict[str, Any]],
) -> tuple[int, Optional[tuple[float, str]]]:
    """Writes the checkpoint into the staging directory ``out``, config.json last (a directory
    without it is never taken for a model); returns the number of quantized linears and, with
    ``verify``, the largest relative reconstruction error and its layer."""
    sdtype = SCALE_DTYPES[scale_dtype]
    writer = _ShardWriter(out)
    bar = _progress(len(checkpoint), f"lowbit2 {codebook} g{group_size}") if progress else None
    bitnet_leaves = () if bitnet is None else ("weight", "weight_scale") if bitnet.packed else ("weight",)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    worst: Optional[tuple[float, str]] = (0.0, "") if verify else None
    sources: dict[str, torch.Tensor] = {}  # float weights held for --verify until their layer is written
    n_quant = 0

    def add(prefix: str, w: LowBitWeight, source_weight: Optional[torch.Tensor]) -> None:
        nonlocal n_quant, worst
        writer.add_lowbit(prefix, w)
        n_quant += 1
        if worst is not None and source_weight is not None:
            ref = source_weight.double()
            err = float((w.dequantize().double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))
            worst = max(worst, (err, prefix))

    for name, t in checkpoint.tensors():
        prefix, _, leaf = name.rpartition(".")
        if bitnet is not None and prefix in linears and leaf in bitnet_leaves:
            parts = pending.setdefault(prefix, {})
            parts[leaf] = t
            if len(parts) == len(bitnet_leaves):
                add(prefix, *_bitnet_weight(bitnet, prefix, pending.pop(prefix), group_size, sdtype))
        elif bitnet is None and leaf == "weight" and prefix in linears:
            if t.dim() != 2 or not t.is_floating_point():
                raise ValueError(f"tensor {name} has dtype {t.dtype} and shape {tuple(t.shape)}; expected a float matrix")
            if verify:
                sources[prefix] = t
            for p, w in grids.add(prefix, t):  # grid layers exactly (merged siblings together), else quantized
                add(p, w, sources.pop(p, None))
        else:
            writer.add(name, t)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    for p, w in grids.finish():
        add(p, w, sources.pop(p, None))
    if pending:
        prefix, parts = sorted(pending.items())[0]
        missing = [leaf for leaf in bitnet_leaves if leaf not in parts]
        raise ValueError(f"BitNet checkpoint: tensor {prefix}.{missing[0]} is missing")
    if n_quant == 0:
        raise ValueError(
            f"{checkpoint.directory}: no linear weight was found to quantize (linear modules: {sorted(linears)[:5]}...)"
        )
    writer.close()

    _copy_side_files(checkpoint.directory, out)
    config["quantization_config"] = quantization_config_dict(
        codebook, group_size, quantizer, scale_dtype, act_group,
        modules_to_not_convert=modules_to_not_convert, source=None if bitnet is None else bf.QUANT_METHOD,
        layer_formats={**layer_formats, **grids.layer_formats},
    )  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return n_quant, worst
