"""Activates the Optimum-Intel integration explicitly (``optimum_npu.register()``): imports
``optimum.intel.openvino.modeling_decoder`` and installs the ``export_npu=True`` hook on it.
The ``aipc_plugins.pth`` autoloader does the same lazily when optimum-intel is imported."""
from __future__ import annotations

import optimum.intel.openvino.modeling_decoder as _modeling_decoder

from .hook import install

install(_modeling_decoder)
