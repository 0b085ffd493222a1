"""The keywords of ``export_npu=True`` (``from_pretrained``, ``export_npu_model``), declared once.

:class:`ExportOptions` shapes and compresses the export, :class:`LoadOptions` loads it,
:class:`HubOptions` finds the checkpoint, :class:`StockOptions` are optimum-intel's own keywords
that ``export_npu=True`` accepts. All are checked by
:func:`aipc_kernels.core.config_schema.parse` (exact types, choices, ranges; errors name the keyword);
rules that tie several keywords together stay with the code that applies them
(``export.validate_shape_args``, ``compression.WeightCompression``). Importing this module is cheap.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Union

from aipc_kernels.core.config_schema import Naming, field_names, option

WEIGHT_FORMATS = ("fp32", "fp16", "int8", "int4")
TARGETS = ("NPU", "CPU", "GPU")

#: errors about export_npu keywords name them as written: ``export_npu: sym='false' must be ...``
NAMING = Naming("export_npu", "python")


@dataclass(frozen=True)
class ExportOptions:
    """Keywords of the export (``export_npu_model``)."""

    max_seq_len: int = option(2048, ge=1)
    prefill_block: int = option(64, ge=1)
    kv_buckets: Optional[list[int]] = option(None, ge=1, example=[256, 512, 1024])
    layers_per_chunk: int = option(2, ge=1)
    weight_format: str = option("fp16", choices=WEIGHT_FORMATS)
    sym: Optional[bool] = option(None)
    group_size: Optional[int] = option(None, example=128)  # positive or -1: WeightCompression checks
    ratio: Optional[float] = option(None, gt=0, le=1)
    all_layers: Optional[bool] = option(None)
    target: str = option("NPU", choices=TARGETS)


@dataclass(frozen=True)
class LoadOptions:
    """Keywords of loading an exported directory (``OVNPUModelForCausalLM``)."""

    device: Optional[str] = option(None, example="NPU")
    ov_config: Optional[dict[str, Any]] = option(None, example={"PERFORMANCE_HINT": "LATENCY"})
    compile: bool = option(True)
    max_compiled_buckets: Optional[int] = option(None, ge=1)
    export_dir: Optional[Union[str, os.PathLike]] = option(None)


@dataclass(frozen=True)
class HubOptions:
    """Keywords that locate a Hub checkpoint to export."""

    revision: Optional[str] = option(None)
    token: Optional[Union[str, bool]] = option(None)
    cache_dir: Optional[Union[str, os.PathLike]] = option(None)
    local_files_only: bool = option(False)


@dataclass(frozen=True)
class StockOptions:
    """Stock ``from_pretrained`` keywords accepted with ``export_npu=True`` when they ask for what the
    export does anyway (``config`` is ignored: the export reads the checkpoint's)."""

    export: Optional[bool] = option(None)
    use_cache: Optional[bool] = option(None, choices=(None, True))
    stateful: Optional[bool] = option(None, choices=(None, True))
    trust_remote_code: Optional[bool] = option(None, choices=(None, False))
    config: Any = option(None)
    force_download: Optional[bool] = option(None, choices=(None, False))
    subfolder: Optional[str] = option(None, choices=(None, ""))


EXPORT_KWARGS = field_names(ExportOptions)
LOAD_KWARGS = field_names(LoadOptions)
HUB_KWARGS = field_names(HubOptions)
STOCK_KWARGS = field_names(StockOptions)

__all__ = ["EXPORT_KWARGS", "ExportOptions", "HUB_KWARGS", "HubOptions", "LOAD_KWARGS", "LoadOptions", "NAMING",
           "STOCK_KWARGS", "StockOptions", "TARGETS", "WEIGHT_FORMATS"]
