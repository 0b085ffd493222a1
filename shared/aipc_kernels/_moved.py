"""The kernel layer's modules under their names before the split by concern (0.1): importing one of
them still works for one release, with a ``DeprecationWarning`` naming the module to import instead,
and gives the very module object of its new name (``isinstance`` and monkeypatching see one module)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old name (under aipc_kernels) -> new name; a package's submodules follow it (triton.lowbit.x)
MOVED: dict[str, str] = {
    "native": "core.native", "config_schema": "core.config_schema", "atomic_output": "core.atomic_output",
    "hf_checkpoint": "core.hf_checkpoint", "registry_models": "core.registry_models",
    "plugin_hooks": "core.plugin_hooks",
    "formats": "lowbit.formats", "packing": "lowbit.packing", "quantizers": "lowbit.quantizers",
    "lowbit_contract": "lowbit.contract", "ops": "lowbit.ops", "planned_ops": "lowbit.planned_ops",
    "modules": "lowbit.modules", "output_projection": "lowbit.output_projection",
    "quality_gate": "lowbit.quality_gate", "weight_schemes": "lowbit.weight_schemes",
    "segment_attention": "decoder.segment_attention", "segment_contract": "decoder.segment_contract",
    "dense_linear": "decoder.dense_linear", "fused_linear": "decoder.fused_linear",
    "fused_lowbit": "decoder.fused_lowbit", "decoder_layer": "decoder.decoder_layer", "rope": "decoder.rope",
    "gguf_format": "checkpoints.gguf", "gptq_format": "checkpoints.gptq", "bitnet_format": "checkpoints.bitnet",
    "grid_detect": "checkpoints.grid_detect",
    "triton.lowbit.cuda_stream": "gpu.cuda.stream", "triton.lowbit.cuda_mma": "gpu.cuda.mma",
    "triton.lowbit.cuda_gemm": "gpu.cuda.gemm", "triton.lowbit.cuda_build": "gpu.cuda.build",
    "triton": "gpu.triton",
    "testing.tiny_model": "tools.tiny_model",
    "testing": "tools",  # the other test helpers left the package (the repository's tests/helpers)
}
PACKAGE = __name__.rpartition(".")[0]
#: MOVED's old names, longest first: a package's submodule matches its most specific entry
_BY_LENGTH = sorted(MOVED, key=len, reverse=True)


def new_name(old: str) -> str | None:
    """The current name of ``aipc_kernels.<old path>``, or None when it did not move."""
    rest = old[len(PACKAGE) + 1:] if old.startswith(PACKAGE + ".") else None
    if rest is None:
        return None
    for moved in _BY_LENGTH:
        if rest == moved or rest.startswith(moved + "."):
            return f"{PACKAGE}.{MOVED[moved]}{rest[len(moved):]}"
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass  # the target module ran already (under its own name)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Finds ``aipc_kernels.<old name>`` and hands out its new module, warning once per name."""

    def find_spec(self, fullname, path=None, target=None):
        target_name = new_name(fullname)
        if target_name is None:
            return None
        warnings.warn(f"{fullname} moved to {target_name}: import that (the old name goes in the next release)",
                      DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _Alias(target_name))


def install() -> None:
    """Puts the finder first on sys.meta_path, once: the path finder would find a moved package's
    submodules through the alias's __path__ and run them a second time under the old name."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())  # before the path finder, which would load a second copy
