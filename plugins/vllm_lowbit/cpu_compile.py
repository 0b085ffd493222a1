"""vLLM-CPU's compiled graph with inductor's C++ wrapper, for the models this plugin's methods serve.

On CPU vLLM compiles the whole model once with inductor (``CompilationMode.DYNAMO_TRACE_ONCE``) and runs it
through inductor's generated *Python* wrapper, which calls every fused C++ kernel and custom op of the graph one
by one each step: about 3 ms of a one-token decode step of Llama-3.2-1B on a 2-core CPU (docs/vllm_lowbit.md,
Measured). Inductor's C++ wrapper (``inductor_compile_config: {"cpp_wrapper": true}``) generates that call
sequence as C++ instead. It cannot pass vLLM's ``LayerName`` (an opaque Python object, the ``layer_name``
argument of the attention and KV-cache ops since torch 2.11), but it can pass a ``str``, which is what vLLM
registers those ops with under ``VLLM_USE_LAYERNAME=0`` (and before torch 2.11). On CPU the whole model is traced
once, so the per-layer recompilation that ``LayerName`` avoids elsewhere does not arise.

:func:`prefer_cpp_wrapper` (run on the ``VllmConfig`` that ``EngineArgs.create_engine_config`` returns) turns the
C++ wrapper on where all of these hold: vLLM-CPU; the model served by one of this plugin's methods
(:data:`METHODS`); the inductor backend of ``DYNAMO_TRACE_ONCE`` (not ``enforce_eager``, not the eager backend);
``cpp_wrapper`` not set by the user (``--compilation-config '{"inductor_compile_config": {"cpp_wrapper":
false}}'`` keeps the Python wrapper); and the process that compiles the model registers ``str`` layer names:
either the engine core is a process of its own (vLLM's default; vLLM-CPU starts it with ``spawn``, so it reads
``VLLM_USE_LAYERNAME``, which is set to ``0`` here unless the user set it) or this process already registered
them as ``str``. Otherwise nothing changes, with an INFO line saying why.
"""
from __future__ import annotations

import functools
import os
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under "vllm": the logger vLLM configures (INFO shows)

#: the quantization methods of this plugin whose models get the C++ wrapper
METHODS = ("lowbit2", "lowbit4", "bitnet", "gguf_cpu")
#: vLLM's switch between ``LayerName`` objects (1, its default on torch >= 2.11) and ``str`` layer names (0)
LAYERNAME_ENV = "VLLM_USE_LAYERNAME"


def _layer_names_are_str_here() -> bool:
    """Whether this process registered vLLM's attention ops with ``str`` layer names."""
    from vllm.utils import torch_utils

    return not getattr(torch_utils, "_USE_LAYERNAME", False)


def prefer_cpp_wrapper(vllm_config: Any) -> bool:
    """Sets ``inductor_compile_config["cpp_wrapper"] = True`` on ``vllm_config`` where the module docstring's
    conditions hold (and ``VLLM_USE_LAYERNAME=0`` in this process's environment for the engine core it starts,
    unless the user set it); returns whether it did."""
    from vllm import envs
    from vllm.config import CompilationMode
    from vllm.platforms import current_platform

    cc = vllm_config.compilation_config
    method = getattr(vllm_config.model_config, "quantization", None)
    if not current_platform.is_cpu() or method not in METHODS:
        return False
    if (cc.mode != CompilationMode.DYNAMO_TRACE_ONCE or cc.backend != "inductor"
            or "cpp_wrapper" in cc.inductor_compile_config):
        return False
    if not _layer_names_are_str_here():
        if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:
            logger.info("%s: the model compiles in this process, whose attention ops take LayerName objects; the "
                        "compiled graph keeps inductor's Python wrapper (set %s=0 before importing vllm for the C++ "
                        "one)", method, LAYERNAME_ENV)  # fmt: skip
            return False
        user = os.environ.get(LAYERNAME_ENV)
        if user not in (None, "0"):
            logger.info("%s: %s=%s (LayerName objects, which inductor's C++ wrapper cannot pass); the compiled graph "
                        "keeps inductor's Python wrapper", method, LAYERNAME_ENV, user)  # fmt: skip
            return False
        os.environ[LAYERNAME_ENV] = "0"  # read by the engine core and its workers, which vLLM-CPU spawns
    cc.inductor_compile_config["cpp_wrapper"] = True
    logger.info("%s on CPU: the compiled graph runs through inductor's C++ wrapper (cpp_wrapper; layer names as str). "
                "--compilation-config '{\"inductor_compile_config\": {\"cpp_wrapper\": false}}' keeps the Python one",
                method)  # fmt: skip
    return True


def install() -> None:
    """Wraps ``EngineArgs.create_engine_config`` so that :func:`prefer_cpp_wrapper` sees each engine's config
    before its engine core starts; idempotent."""
    original = EngineArgs.create_engine_config
    if getattr(original, "_lowbit_cpp_wrapper", False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        config = original(self, *args, **kwargs)
        prefer_cpp_wrapper(config)
        return config

    create_engine_config._lowbit_cpp_wrapper = True  # (functools.wraps keeps the GGUF routing's marker too)
    EngineArgs.create_engine_config = create_engine_config


install()
