"""Post-import hook: teaches ``OVModelForCausalLM.from_pretrained`` the ``export_npu=True`` path.

Called by ``aipc_kernels._autoload`` right after ``optimum.intel.openvino.modeling_decoder`` is
imported. optimum-intel drops unknown keyword arguments silently, so without this hook
``export_npu=True`` would give a dynamic model without a word.
Importing this module imports nothing heavy; the exporter loads on first use.
"""
from __future__ import annotations

import inspect
import types
import warnings
from typing import Any

from aipc_kernels.core.config_schema import parse

from .manifest import check_export_complete, is_npu_export
from .options import (EXPORT_KWARGS, HUB_KWARGS, LOAD_KWARGS, NAMING, STOCK_KWARGS, ExportOptions, HubOptions,
                      LoadOptions, StockOptions)

#: optimum-intel versions whose from_pretrained/GenerationMixin contract this was built against
SUPPORTED_OPTIMUM_INTEL = ((2, 2), (2, 3))  # >= 2.2, < 2.3
_MARK = "_optimum_npu_original_from_pretrained"


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
        if export_npu is not None and not isinstance(export_npu, bool):
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
    if type(bits) is not int or bits not in (4, 8):
        raise ValueError(f"quantization_config bits={bits!r}: export_npu compresses weights to 4 or 8 "
                         "bits (or pass weight_format='fp16')")
    out["weight_format"] = f"int{bits}"
    for key in ("sym", "group_size", "ratio", "all_layers"):
        if q.get(key) is not None and not (bits == 8 and key in ("group_size", "ratio")):
            out[key] = q[key]
    return out


def load_npu_model(model_id: Any, **kwargs: Any):
    """``from_pretrained(model_id, export_npu=True, **kwargs)``: checks every keyword before any
    work (unknown ones raise naming the accepted ones; values against
    :mod:`optimum_npu.options`) and exports or loads through OVNPUModelForCausalLM."""
    parse(StockOptions, {k: kwargs.pop(k) for k in STOCK_KWARGS if k in kwargs}, NAMING)
    kwargs.update(quantization_kwargs(kwargs.pop("quantization_config", None),
                                      kwargs.pop("load_in_8bit", None)))
    accepted = EXPORT_KWARGS + LOAD_KWARGS + HUB_KWARGS
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"from_pretrained(export_npu=True) got unexpected keyword(s) "
                        f"{', '.join(unknown)}; accepted: {', '.join(accepted + STOCK_KWARGS)}, "
                        "quantization_config, load_in_8bit")
    export = {k: kwargs[k] for k in EXPORT_KWARGS if k in kwargs}
    load = {k: kwargs[k] for k in LOAD_KWARGS if k in kwargs}
    hub = {k: kwargs[k] for k in HUB_KWARGS if k in kwargs}
    for schema, given in ((ExportOptions, export), (LoadOptions, load), (HubOptions, hub)):
        parse(schema, given, NAMING)
    from .modeling import OVNPUModelForCausalLM

    exporting = not is_npu_export(model_id)
    if not exporting:
        hub = {}  # a local exported directory: nothing to fetch
    return OVNPUModelForCausalLM.from_pretrained(model_id, export=exporting, **load, **export, **hub)
