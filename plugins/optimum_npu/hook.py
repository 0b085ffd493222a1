"""Post-import hook: teaches ``OVModelForCausalLM.from_pretrained`` the ``export_npu=True`` path.

Called by ``aipc_kernels._autoload`` right after ``optimum.intel.openvino.modeling_decoder`` is
imported (or by ``optimum_npu.integration``). optimum-intel drops unknown keyword arguments
silently, so without this hook ``export_npu=True`` would give a dynamic model without a word.
Importing this module imports nothing heavy; the exporter loads on first use.
"""
from __future__ import annotations

import inspect
import types
import warnings
from typing import Any

from .manifest import check_export_complete, is_npu_export

#: optimum-intel versions whose from_pretrained/GenerationMixin contract this was built against
SUPPORTED_OPTIMUM_INTEL = ((2, 2), (2, 3))  # >= 2.2, < 2.3
_MARK = "_optimum_npu_original_from_pretrained"

#: keywords of the NPU export (export_npu_model) and of loading it (OVNPUModelForCausalLM)
EXPORT_KWARGS = ("max_seq_len", "prefill_block", "kv_buckets", "layers_per_chunk", "weight_format",
                 "sym", "group_size", "ratio", "all_layers", "target")
LOAD_KWARGS = ("device", "ov_config", "compile", "max_compiled_buckets", "export_dir")
HUB_KWARGS = ("revision", "token", "cache_dir", "local_files_only")
# stock keywords that keep their meaning, or are accepted when they ask what the export does anyway
_PASSIVE = {"export": (None, True, False), "use_cache": (None, True), "stateful": (None, True),
            "trust_remote_code": (None, False), "config": None, "force_download": (None, False),
            "subfolder": (None, "")}


def _version_ok() -> tuple[bool, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("optimum-intel")
    except PackageNotFoundError:
        return False, "not installed"
    try:
        key = tuple(int(p) for p in v.split(".")[:2])
    except ValueError:
        return False, v
    lo, hi = SUPPORTED_OPTIMUM_INTEL
    return lo <= key < hi, v


def install(module: types.ModuleType) -> None:
    """Wraps ``module.OVModelForCausalLM.from_pretrained`` (idempotent). Outside the supported
    optimum-intel range it warns and leaves optimum-intel untouched."""
    cls = module.OVModelForCausalLM
    if _MARK in cls.__dict__:
        return
    ok, version = _version_ok()
    if not ok:
        lo, hi = SUPPORTED_OPTIMUM_INTEL
        warnings.warn(
            f"optimum_npu: optimum-intel {version} is outside the supported range "
            f">={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}; export_npu=True is not available (use "
            "optimum_npu.OVNPUModelForCausalLM directly, or install optimum-intel "
            f"{lo[0]}.{lo[1]}.*)", RuntimeWarning, stacklevel=2)
        return
    original = inspect.getattr_static(cls, "from_pretrained").__func__

    def from_pretrained(klass, model_id, *args, export_npu: bool | None = None, **kwargs):
        if export_npu not in (None, True, False):
            raise TypeError(f"export_npu={export_npu!r} must be True or False")
        ours = sorted(k for k in kwargs if k in EXPORT_KWARGS + ("max_compiled_buckets", "export_dir"))
        if export_npu is not False:
            check_export_complete(model_id)  # an interrupted export, named as such
        if export_npu is None and is_npu_export(model_id):
            export_npu = True
        if not export_npu:
            if ours:
                raise TypeError(f"{', '.join(ours)} only apply with export_npu=True; pass "
                                "export_npu=True or drop them")
            return original(klass, model_id, *args, **kwargs)
        if args:
            raise TypeError("with export_npu=True, pass options as keywords (positional: "
                            f"{args!r})")
        return load_npu_model(model_id, **kwargs)

    from_pretrained.__doc__ = (original.__doc__ or "") + (
        "\n\n        optimum_npu: ``export_npu=True`` exports (or loads) a chunked, stateful, "
        "static-shape model for Intel NPUs; see optimum_npu.export_npu_model for its keywords.")
    setattr(cls, _MARK, original)
    cls.from_pretrained = classmethod(from_pretrained)


def quantization_kwargs(quantization_config: Any, load_in_8bit: bool | None) -> dict[str, Any]:
    """Maps optimum-intel's ``quantization_config`` (an ``OVWeightQuantizationConfig`` or its dict)
    and ``load_in_8bit`` to the exporter's weight-compression keywords."""
    out: dict[str, Any] = {}
    if load_in_8bit:
        out["weight_format"] = "int8"
    if quantization_config is None:
        return out
    q = quantization_config if isinstance(quantization_config, dict) else (
        quantization_config.to_dict() if hasattr(quantization_config, "to_dict") else None)
    if q is None:
        raise TypeError(f"quantization_config={quantization_config!r}: pass an "
                        "OVWeightQuantizationConfig or a dict with bits/sym/group_size/ratio")
    bits = q.get("bits")
    if bits not in (4, 8):
        raise ValueError(f"quantization_config bits={bits!r}: export_npu compresses weights to 4 or 8 "
                         "bits (or pass weight_format='fp16')")
    out["weight_format"] = f"int{bits}"
    for key in ("sym", "group_size", "ratio", "all_layers"):
        if q.get(key) is not None and not (bits == 8 and key in ("group_size", "ratio")):
            out[key] = q[key]
    return out


def load_npu_model(model_id: Any, **kwargs: Any):
    """``from_pretrained(model_id, export_npu=True, **kwargs)``: validates the keywords (unknown
    ones raise, naming the accepted ones) and exports or loads through OVNPUModelForCausalLM."""
    from .modeling import OVNPUModelForCausalLM

    for key, allowed in _PASSIVE.items():
        if key in kwargs:
            value = kwargs.pop(key)
            if allowed is not None and value not in allowed:
                raise ValueError(f"{key}={value!r} is not supported with export_npu=True "
                                 f"(accepted: {allowed})")
    kwargs.update(quantization_kwargs(kwargs.pop("quantization_config", None),
                                      kwargs.pop("load_in_8bit", None)))
    accepted = EXPORT_KWARGS + LOAD_KWARGS + HUB_KWARGS
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"from_pretrained(export_npu=True) got unexpected keyword(s) "
                        f"{', '.join(unknown)}; accepted: {', '.join(accepted + tuple(_PASSIVE))}, "
                        "quantization_config, load_in_8bit")
    load = {k: kwargs.pop(k) for k in LOAD_KWARGS if k in kwargs}
    exporting = not is_npu_export(model_id)
    if not exporting:
        hub = [k for k in HUB_KWARGS if k in kwargs]
        for k in hub:
            kwargs.pop(k)
    return OVNPUModelForCausalLM.from_pretrained(model_id, export=exporting, **load, **kwargs)
