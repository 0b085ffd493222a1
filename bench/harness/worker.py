"""A bench row measured in a worker process of its own (the vLLM benches: one engine per process),
which prints its row as one ``RESULT=<json>`` line on stdout."""
from __future__ import annotations

import json
import os
import subprocess
from typing import Optional

RESULT_PREFIX = "RESULT="
_ERROR_MARKS = ("Error:", "error,", "error:", "Exception:")
#: the environment of a vLLM-CPU engine in the worker process itself. VLLM_USE_LAYERNAME=0 (unless the caller's
#: environment sets it): the worker then registers vLLM's attention ops with str layer names, so the plugin's models
#: run inductor's C++ wrapper there, as the engine core of `vllm serve` or a default LLM() gets it
#: (vllm_lowbit.cpu_compile); VLLM_USE_LAYERNAME=1 keeps the Python one
IN_PROCESS_VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "TOKENIZERS_PARALLELISM": "false",
                       "VLLM_USE_LAYERNAME": os.environ.get("VLLM_USE_LAYERNAME", "0")}  # fmt: skip


def run_worker(name: str, cmd: list[str], env: dict[str, str]) -> tuple[Optional[dict], str]:
    """Runs ``cmd`` and returns (its ``RESULT=`` row, "") or, when it failed, (None, the reason: its exit
    status and its last error line); a failure also prints the worker's stderr tail under ``[name]``."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT_PREFIX) :]), ""
    err = proc.stderr.strip().splitlines() or ["?"]
    last = ([ln for ln in err if any(m in ln for m in _ERROR_MARKS)] or err)[-1].strip()[:300]
    reason = f"its process failed (exit {proc.returncode}): {last}"
    print(f"[{name}] {reason}\n{proc.stderr[-4000:]}", flush=True)
    return None, reason
