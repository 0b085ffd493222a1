"""``OVNPUModelForCausalLM``: runs an exported directory (chunked, stateful, static IRs) as a
transformers ``GenerationMixin`` model.

One sequence (batch 1) at a time. The prompt goes through the prefill chunks ``prefill_block``
tokens per call (KV capacity ``prefill_capacity``); its KV states are then handed to the decode
chunks of the smallest KV bucket that holds the context, and moved to the next bucket when the
context outgrows it, so a decode step attends over what the context needs, not ``max_seq_len``.

LongRoPE exports (Phi-3.5) take the sequence length as an input that picks the short or long
factors in the graph. Once a sequence grows past ``original_max_position_embeddings``, the keys
cached with the short factors are recomputed: the whole sequence is prefilled again with the long
ones, once, as transformers' Phi-3 does when its ``generate`` crosses that length.
"""
from __future__ import annotations

import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import torch
from transformers import AutoConfig, GenerationConfig, GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

from aipc_kernels.core.atomic_output import signals_raise, temporary_output_dir
from aipc_kernels.core.config_schema import parse

from .manifest import (COMPILE_CACHE_DIR, LOGITS, POSITION, SEQUENCE_LENGTH, TOKEN, X, X_OUT, ChunkFile,
                       NPUExportManifest, check_export_complete, is_npu_export)
from .options import NAMING, LoadOptions

logger = logging.getLogger(__name__)


class SequenceTooLongError(ValueError):
    """The sequence would outgrow the exported ``max_seq_len``."""


def pick_device(device: str | None, core: ov.Core) -> str:
    """``device`` if given, else NPU when OpenVINO sees one, else CPU with a one-line warning."""
    if device:
        return device.upper()
    if "NPU" in core.available_devices:
        return "NPU"
    warnings.warn("optimum_npu: no NPU found by OpenVINO; running the static chunks on CPU",
                  stacklevel=3)
    return "CPU"


class OVNPUModelForCausalLM(GenerationMixin):
    """A causal LM exported by ``optimum_npu.export_npu_model`` (``npu_export.json`` directory).

    ``from_pretrained(dir)`` loads an exported directory; ``from_pretrained(model_id, export=True,
    max_seq_len=..., ...)`` exports first (the keywords of ``export_npu_model``).
    """

    main_input_name = "input_ids"
    _supports_cache_class = False
    _is_stateful = False
    base_model_prefix = "npu"

    def __init__(self, directory: str | os.PathLike, *, device: str | None = None,
                 ov_config: dict[str, Any] | None = None, compile: bool = True,
                 max_compiled_buckets: int | None = None, config=None,
                 generation_config: GenerationConfig | None = None,
                 _owned_dir: tempfile.TemporaryDirectory | None = None):
        self.model_dir = Path(directory)
        check_export_complete(self.model_dir)
        if not is_npu_export(self.model_dir):
            raise ValueError(f"{self.model_dir} is not an export_npu directory (no npu_export.json); "
                             "export it first: OVModelForCausalLM.from_pretrained(id, export_npu=True)")
        self.manifest = NPUExportManifest.read(self.model_dir)
        self.config = config or AutoConfig.from_pretrained(self.model_dir)
        if generation_config is None:
            try:
                generation_config = GenerationConfig.from_pretrained(self.model_dir)
            except OSError:
                generation_config = GenerationConfig.from_model_config(self.config)
        self.generation_config = generation_config
        parse(LoadOptions, dict(device=device, ov_config=ov_config, compile=compile,
                                max_compiled_buckets=max_compiled_buckets), NAMING)
        self.core = ov.Core()
        self.ov_device = pick_device(device, self.core)
        self.ov_config = {"CACHE_DIR": str(self.model_dir / COMPILE_CACHE_DIR), **(ov_config or {})}
        self.max_compiled_buckets = max_compiled_buckets
        self._owned_dir = _owned_dir  # keeps a temporary export alive as long as the model
        self._compiled: dict[str, ov.CompiledModel] = {}
        self._requests: dict[str, list[ov.InferRequest]] = {}
        self._pos = 0
        self._tokens: list[int] = []  # the sequence in the KV states (LongRoPE recomputes it)
        self._live: str | None = None  # the request set holding the KV: "prefill" or "kv<C>"
        longrope = self.manifest.longrope or {}
        self._rope_switch: int | None = longrope.get("original_max_position_embeddings")
        if compile:
            self.compile()

    # -- loading ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_id: str | os.PathLike, *, export: bool | None = None,
                        device: str | None = None, ov_config: dict[str, Any] | None = None,
                        compile: bool = True, max_compiled_buckets: int | None = None,
                        export_dir: str | os.PathLike | None = None,
                        **export_kwargs: Any) -> "OVNPUModelForCausalLM":
        """Loads an exported directory, or exports ``model_id`` first (into ``export_dir``, else a
        temporary directory ``$TMPDIR/optimum_npu_<pid>_*/model`` kept while the model lives and
        removed when the export fails or is interrupted) when it is not one."""
        from .export import export_npu_model

        load = dict(device=device, ov_config=ov_config, compile=compile,
                    max_compiled_buckets=max_compiled_buckets)
        check_export_complete(model_id)
        if is_npu_export(model_id) and not export:
            check_export_matches(model_id, export_kwargs)
            return cls(model_id, **load)
        if export is False:
            raise ValueError(f"{model_id} is not an export_npu directory and export=False; "
                             "pass export=True to export it")
        with signals_raise():  # SIGTERM, too, removes a temporary export
            owned = None
            if export_dir is None:
                owned = temporary_output_dir("optimum_npu_")
                export_dir = Path(owned.name) / "model"
                logger.info("exporting %s into the temporary directory %s (removed with the model; "
                            "pass export_dir= or call save_pretrained() to keep it)", model_id,
                            export_dir)
            try:
                export_npu_model(model_id, export_dir, **export_kwargs)
                return cls(export_dir, _owned_dir=owned, **load)
            except BaseException:
                if owned is not None:
                    owned.cleanup()
                raise

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Copies the exported directory (IRs, manifest, config, tokenizers) to ``save_directory``."""
        from .export import copy_export

        return copy_export(self.model_dir, save_directory)

    # -- compilation ------------------------------------------------------------------------
    def _compile_file(self, chunk: ChunkFile) -> ov.CompiledModel:
        if chunk.xml not in self._compiled:
            model = self.core.read_model(self.model_dir / chunk.xml, self.model_dir / chunk.weights)
            self._compiled[chunk.xml] = self.core.compile_model(model, self.ov_device, self.ov_config)
        return self._compiled[chunk.xml]

    def _chunk_files(self, key: str) -> list[ChunkFile]:
        m = self.manifest
        if key == "embed":
            return [m.embedding]
        if key == "head":
            return [m.head]
        if key == "prefill":
            return [g.prefill for g in m.layer_groups]
        return [g.decode[key[2:]] for g in m.layer_groups]

    def _requests_for(self, key: str) -> list[ov.InferRequest]:
        if key not in self._requests:
            if key.startswith("kv") and self.max_compiled_buckets is not None:
                # evict idle buckets (never the live one, whose states may be about to move)
                idle = [k for k in self._requests if k.startswith("kv") and k != self._live]
                while idle and sum(k.startswith("kv") for k in self._requests) >= \
                        self.max_compiled_buckets:
                    self._drop(idle.pop(0))
            self._requests[key] = [self._compile_file(f).create_infer_request()
                                   for f in self._chunk_files(key)]
        return self._requests[key]

    def _drop(self, key: str) -> None:
        for f in self._chunk_files(key):
            self._compiled.pop(f.xml, None)
        self._requests.pop(key, None)

    def compile(self, all_buckets: bool = False) -> None:
        """Compiles what a first sequence needs (embedding, head, prefill, smallest KV bucket), or
        every KV bucket with ``all_buckets=True``; the rest compiles on first use."""
        buckets = self.manifest.kv_buckets if all_buckets else self.manifest.kv_buckets[:1]
        for key in ["embed", "head", "prefill"] + [f"kv{c}" for c in buckets]:
            self._requests_for(key)

    def compile_cache_hits(self) -> dict[str, bool]:
        """Per compiled IR: whether OpenVINO loaded it from the compile cache (``CACHE_DIR``)."""
        return {name: bool(cm.get_property("LOADED_FROM_CACHE"))
                for name, cm in self._compiled.items()}

    # -- state ------------------------------------------------------------------------------
    def reset_state(self) -> None:
        """Starts a new sequence: zeroes every KV state."""
        for reqs in self._requests.values():
            for r in reqs:
                r.reset_state()
        self._pos = 0
        self._tokens = []
        self._live = None

    def _move_states(self, src: str, dst: str) -> None:
        """Copies the KV of the ``src`` request set into ``dst`` (capacities may differ: the
        first ``min`` slots are copied, the rest zeroed); ``dst`` becomes the live set."""
        dst_reqs = self._requests_for(dst)
        src_reqs = self._requests[src]
        for s_req, d_req in zip(src_reqs, dst_reqs, strict=True):
            source = {s.name: s.state for s in s_req.query_state()}
            for d in d_req.query_state():
                s_t = source[d.name]
                d_t = d.state
                s_arr = np.asarray(s_t.data)
                shape = tuple(d_t.shape) if d_t.size else (
                    s_arr.shape[0], s_arr.shape[1], self._capacity(dst), s_arr.shape[3])
                new = np.zeros(shape, dtype=s_arr.dtype)
                n = min(shape[2], s_arr.shape[2])
                new[:, :, :n] = s_arr[:, :, :n]
                d.state = ov.Tensor(new)
        self._live = dst

    def _capacity(self, key: str) -> int:
        return self.manifest.prefill_capacity if key == "prefill" else int(key[2:])

    # -- running the chunks -----------------------------------------------------------------
    def _layers(self, key: str, x: np.ndarray, position: int, sequence_length: int) -> np.ndarray:
        inputs = {X: x, POSITION: np.array([position], dtype=np.int64)}
        if self._rope_switch is not None:
            inputs[SEQUENCE_LENGTH] = np.array([sequence_length], dtype=np.int64)
        for req in self._requests_for(key):
            req.infer(inputs)
            inputs[X] = np.array(req.get_tensor(X_OUT).data)
        return inputs[X]

    def _short_rope_cached(self, new_tokens: int) -> bool:
        """Whether the KV states hold keys rotated with LongRoPE's short factors that ``new_tokens``
        more tokens would take past ``original_max_position_embeddings`` (then all are recomputed)."""
        switch = self._rope_switch
        return switch is not None and 0 < self._pos <= switch < self._pos + new_tokens

    def _embed(self, ids: list[int]) -> np.ndarray:
        block = self.manifest.prefill_block
        tokens = np.zeros((1, block), dtype=np.int64)
        pad = self.generation_config.pad_token_id
        tokens[:] = pad if isinstance(pad, int) and 0 <= pad < self.manifest.vocab_size else 0
        tokens[0, :len(ids)] = ids
        req = self._requests_for("embed")[0]
        req.infer({TOKEN: tokens})
        return np.array(req.get_tensor(X).data)

    def _head(self, x: np.ndarray) -> np.ndarray:
        req = self._requests_for("head")[0]
        req.infer({X: x})
        return np.array(req.get_tensor(LOGITS).data)

    def _run_prompt(self, ids: list[int]) -> np.ndarray:
        block = self.manifest.prefill_block
        if self._live not in (None, "prefill"):
            self._move_states(self._live, "prefill")
        self._live = "prefill"
        x = None
        total = self._pos + len(ids)
        for start in range(0, len(ids), block):
            part = ids[start:start + block]
            x = self._layers("prefill", self._embed(part), self._pos, total)
            self._pos += len(part)
            self._tokens.extend(part)
            last = len(part) - 1
        return self._head(x[:, last:last + 1])

    def _run_token(self, token: int) -> np.ndarray:
        capacity = next(c for c in self.manifest.kv_buckets if c > self._pos)
        key = f"kv{capacity}"
        if self._live is not None and self._live != key:
            self._move_states(self._live, key)
        self._live = key
        x = self._layers(key, self._embed([token])[:, :1], self._pos, self._pos + 1)
        self._pos += 1
        self._tokens.append(token)
        return self._head(x)

    # -- transformers interface -------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @classmethod
    def can_generate(cls) -> bool:
        return True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                past_key_values: Any = None, position_ids: torch.Tensor | None = None,
                **kwargs: Any) -> CausalLMOutputWithPast:
        """Runs ``input_ids`` ([1, n]) after what the states hold (``past_key_values`` not None)
        or as a new sequence (None: states reset); returns the last position's logits."""
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids of shape {tuple(input_ids.shape)}: the NPU export runs one "
                             "sequence at a time; pass input_ids of shape [1, n]")
        if attention_mask is not None and not bool(torch.all(attention_mask != 0)):
            raise ValueError("attention_mask has padding: the NPU export runs one unpadded sequence; "
                             "drop the padding (batch 1, no pad tokens)")
        if past_key_values is None:
            self.reset_state()
        n = input_ids.shape[1]
        limit = self.manifest.max_seq_len
        if n == 0:
            raise ValueError("input_ids is empty; pass at least one token")
        if self._pos + n > limit:
            raise SequenceTooLongError(
                f"sequence of {self._pos + n} tokens exceeds max_seq_len={limit} of this NPU export "
                f"({self._pos} in the KV cache + {n} new); shorten the prompt or max_new_tokens, or "
                "re-export with a larger max_seq_len")
        ids = input_ids[0].tolist()
        if self._short_rope_cached(n):
            ids = self._tokens + ids
            self.reset_state()
        logits = self._run_prompt(ids) if len(ids) > 1 else self._run_token(ids[0])
        return CausalLMOutputWithPast(logits=torch.from_numpy(logits), past_key_values=((),))

    def generate(self, inputs: torch.Tensor | None = None, generation_config=None, **kwargs):
        """``GenerationMixin.generate`` (greedy, sampling, streamers; batch 1, no beam search);
        raises before generating when prompt + ``max_new_tokens`` exceed ``max_seq_len``."""
        gen_config, _ = self._prepare_generation_config(generation_config, **kwargs)
        if (gen_config.num_beams or 1) > 1:
            raise ValueError(f"num_beams={gen_config.num_beams}: the NPU export runs one sequence "
                             "(greedy or sampling); use num_beams=1")
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if ids is not None:
            total = ids.shape[-1] + (gen_config.max_new_tokens or 0)
            if gen_config.max_new_tokens is None and gen_config.max_length:
                total = max(gen_config.max_length, ids.shape[-1])
            if total > self.manifest.max_seq_len:
                raise SequenceTooLongError(
                    f"prompt ({ids.shape[-1]} tokens) + max_new_tokens would reach {total} tokens, "
                    f"past max_seq_len={self.manifest.max_seq_len} of this NPU export; lower "
                    "max_new_tokens or re-export with a larger max_seq_len")
        return super().generate(inputs, generation_config, **kwargs)

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None,
                                      **kwargs):
        if past_key_values is not None:
            input_ids = input_ids[:, self._pos:]
        return {"input_ids": input_ids, "past_key_values": past_key_values,
                "attention_mask": attention_mask}

    def _prepare_cache_for_generation(self, *args, **kwargs):
        return

    def _reorder_cache(self, past_key_values, beam_idx):
        raise ValueError("beam search is not supported by the NPU export; use num_beams=1")

    def _get_past_length(self, past_key_values=None) -> int:
        return 0 if past_key_values is None else self._pos


def check_export_matches(directory: str | os.PathLike, export_kwargs: dict[str, Any]) -> None:
    """Raises when export options given for an already exported directory differ from it."""
    if not export_kwargs:
        return
    m = NPUExportManifest.read(directory)
    have = dict(max_seq_len=m.max_seq_len, prefill_block=m.prefill_block, kv_buckets=m.kv_buckets,
                weight_format=(m.quantization or {}).get("weight_format", "fp16/fp32"))
    unknown = sorted(set(export_kwargs) - set(have))
    if unknown:
        raise TypeError(f"{', '.join(unknown)} cannot be applied to the already exported {directory}; "
                        "export again from the original checkpoint")
    for k, v in export_kwargs.items():
        want = v if k != "kv_buckets" else sorted(set(v) | {m.max_seq_len})
        if k == "weight_format" and v in ("fp16", "fp32") and m.quantization is None:
            continue
        if want != have[k]:
            raise ValueError(f"{directory} was exported with {k}={have[k]!r}, not {v!r}; export "
                             "again from the original checkpoint to change it")
