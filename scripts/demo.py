"""The main demo, end to end on an embedded default, on a fresh machine:

    python3 scripts/demo.py

Builds the vLLM environment (scripts/envs.py), a tiny local Llama with an offline-trained tokenizer,
quantizes its linear layers to lowbit2 and generates with the native CPU kernels. Each plugin's part
runs as far as that plugin exists.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envs  # noqa: E402

if __name__ == "__main__":
    py = envs.ensure_env(envs.ENVS["vllm"], {})
    sys.exit(subprocess.run([str(py), str(envs.ROOT / "scripts" / "demo_lowbit.py"), *sys.argv[1:]]).returncode)
