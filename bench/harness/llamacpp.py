"""llama.cpp, the CPU peer of the end-to-end benches: built from the vendored sources of the
``llama-cpp-python`` sdist on the package registry (recipe: ../shared/notes/peer_llamacpp.md), a float
Hugging Face directory converted by its own ``convert_hf_to_gguf.py --outtype bf16`` and quantized by
``llama-quantize``, the GGUF's bytes read with its ``gguf-py``, and rows timed with ``llama-bench``
(its JSON output), with the peak resident memory of the timed process.

Everything lives under one cache folder (``--llamacpp-cache``): ``src/`` (the sdist), ``build/``
(the binaries) and ``gguf/<key>/model-<qtype>.gguf`` (``key``: the float model)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Callable, Optional

from harness.bandwidth import read_bandwidth

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
DEFAULT_CACHE = Path.home() / ".cache" / "aipc-plugins" / "llamacpp"
LINEAR_NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")  # GGUF names


# CMake options per instruction set: the CPU's own (GGML_NATIVE), or one forced for a comparison with our
# kernels under AIPC_ISA (AVX2 / AVX-VNNI: the widest that client CPUs without AVX-512 have). Without
# GGML_NATIVE, ggml enables AVX, AVX2, BMI2, FMA and F16C and leaves every AVX-512 option off.
# ``native_no_amx``: the CPU's own minus AMX, whose ggml path (``ggml_backend_amx_mul_mat``) dies with a general
# protection fault in llama-bench and llama-server on the 2-core Xeon with AMX here (Q4_0, Q4_K_M, Q8_0: a known,
# unfixed llama.cpp crash, ggml-org/llama.cpp#20824); explicit -mno-amx-* flags outrank GCC's -march=native.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
ISA_OPTIONS = {
    "native": ["-DGGML_NATIVE=ON"],
    "native_no_amx": ["-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"],
    "avx_vnni": ["-DGGML_NATIVE=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=ON"],
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``--llamacpp-cache``, ``--build-llamacpp`` and ``--llamacpp-isa``, as every bench with llama.cpp
    rows spells them."""
    ap.add_argument("--llamacpp-cache", type=Path, default=DEFAULT_CACHE,
                    help="llama.cpp sources, build and GGUFs (default: %(default)s)")
    ap.add_argument("--build-llamacpp", action="store_true",
                    help="download the llama-cpp-python sdist and build llama.cpp into --llamacpp-cache if absent")
    ap.add_argument("--llamacpp-isa", choices=sorted(ISA_OPTIONS), default="native",
                    help="the instruction sets llama.cpp is built for (its own build folder each); force the same "
                         "on our side with AIPC_ISA (default: %(default)s)")


# ---------------------------------------------------------------------- build


def llamacpp_src(cache: Path) -> Path:
    return cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"


#: the tools every bench may run (llama-server needs LLAMA_BUILD_SERVER=ON); a build makes them all
TOOLS = ("llama-bench", "llama-quantize", "llama-perplexity", "llama-server")
#: what the decode benches (vllm_e2e, bitnet_e2e) run: a build folder made before the other tools were added serves them
BENCH_TOOLS = ("llama-bench", "llama-quantize")


def cpu_key() -> str:
    """A short key of this CPU's model name and flags: a native build (``-march=native``) made on one CPU
    dies with SIGILL on another, so a cache moved between machines gets a native build per CPU."""
    import hashlib

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def build_dir(cache: Path, isa: str = "native") -> Path:
    """The build folder of llama.cpp for ``isa`` (a key of :data:`ISA_OPTIONS`); the native ones are per CPU
    (:func:`cpu_key`)."""
    if isa not in ISA_OPTIONS:
        raise ValueError(f"llama.cpp isa={isa!r}: use one of {sorted(ISA_OPTIONS)}")
    return cache / (f"build-{isa}-{cpu_key()}" if isa.startswith("native") else f"build-{isa}")


def llamacpp_bin(cache: Path, tool: str, isa: str = "native") -> Path:
    return build_dir(cache, isa) / "bin" / tool


def build_hint(cache: Path, isa: str = "native") -> str:
    src = llamacpp_src(cache)
    build = build_dir(cache, isa)
    return (f"llama.cpp is not built in {cache}: rerun with --build-llamacpp (about 20 min on 2 cores), or by hand: "
            f"python -m pip download --no-deps --no-binary :all: llama-cpp-python=={LLAMA_CPP_PYTHON} -d {cache}/src && "
            f"tar xzf {cache}/src/llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz -C {cache}/src && "
            f"cmake -S {src} -B {build} {shlex.join(ISA_OPTIONS[isa])} -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF "
            "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release && "
            f"nice -n 10 cmake --build {build} -j2 --target {' '.join(TOOLS)}")  # fmt: skip


def llamacpp_ready(cache: Path, isa: str = "native", tools: tuple = TOOLS) -> bool:
    return all(llamacpp_bin(cache, t, isa).exists() for t in tools) and \
        (llamacpp_src(cache) / "convert_hf_to_gguf.py").exists()


def build_llamacpp(cache: Path, isa: str = "native") -> None:
    """Downloads the ``llama-cpp-python`` sdist from the package registry, unpacks it and builds
    :data:`TOOLS` from its vendored llama.cpp (the recipe of
    ../shared/notes/peer_llamacpp.md)."""
    src_root = cache / "src"
    src_root.mkdir(parents=True, exist_ok=True)
    sdist = src_root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(src_root)], check=True)  # fmt: skip
    if not (llamacpp_src(cache) / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(src_root, filter="data")
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []
    subprocess.run(nice + ["cmake", "-S", str(llamacpp_src(cache)), "-B", str(build_dir(cache, isa)), *ISA_OPTIONS[isa],
                           "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                           "-DLLAMA_BUILD_SERVER=ON", "-DCMAKE_BUILD_TYPE=Release"], check=True)  # fmt: skip
    subprocess.run(nice + ["cmake", "--build", str(build_dir(cache, isa)), f"-j{os.cpu_count() or 1}",
                           "--target", *TOOLS], check=True)  # fmt: skip


def ensure_built(cache: Path, build: bool, isa: str = "native", tools: tuple = TOOLS) -> Optional[str]:
    """None when llama.cpp's ``tools`` are (or, with ``build``, have just been) built in ``cache`` for ``isa``;
    otherwise prints how to build it and returns the reason its rows are skipped."""
    if llamacpp_ready(cache, isa, tools):
        return None
    if build:
        build_llamacpp(cache, isa)
        return None
    print(f"[llama.cpp] {build_hint(cache, isa)}", flush=True)
    return f"llama.cpp not built in {build_dir(cache, isa)} (--build-llamacpp)"


# ---------------------------------------------------------------------- convert, quantize


def sentencepiece_model(path: Path) -> None:
    """A small SentencePiece ``tokenizer.model`` at ``path``. llama.cpp's converter reads a Llama or
    BitNet vocabulary from one (``_set_vocab_sentencepiece``) and pads it with [PAD] tokens up to
    ``vocab_size``; the fixtures' offline-trained byte-level BPE ``tokenizer.json`` is not in its
    pre-tokenizer table ("BPE pre-tokenizer was not recognized"). The tokens do not change the timing."""
    import io

    import sentencepiece as spm

    from aipc_kernels.tools.tiny_model import _corpus

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=512,
                                   model_type="bpe", character_coverage=1.0, num_threads=1, hard_vocab_limit=False,
                                   minloglevel=2)  # fmt: skip
    path.write_bytes(buf.getvalue())


def stage_float_model(src: Path, stage: Path) -> None:
    """``src`` (a float Hugging Face directory) as llama.cpp's converter reads it: ``config.json`` and
    the safetensors linked, not copied, and a SentencePiece ``tokenizer.model`` in place of its
    tokenizer (:func:`sentencepiece_model`)."""
    stage.mkdir(parents=True)
    files = [src / "config.json", *sorted(src.glob("*.safetensors")), *src.glob("model.safetensors.index.json")]
    if len(files) < 2:
        raise FileNotFoundError(f"stage_float_model: {src} has no config.json + *.safetensors")
    for f in files:
        (stage / f.name).symlink_to(f.resolve())
    sentencepiece_model(stage / "tokenizer.model")


def ggufs(stage: Callable[[Path], None], cache: Path, qtypes: list[str], key: str, isa: str = "native") -> dict[str, Path]:
    """The GGUFs of one float model: ``stage(dir)`` writes the Hugging Face directory llama.cpp's own
    ``convert_hf_to_gguf.py`` converts (``--outtype bf16``), and ``llama-quantize`` quantizes the
    result to each of ``qtypes``; cached as ``cache/gguf/<key>/model-<qtype>.gguf`` (``key``: the float
    model). Returns {qtype: path}."""
    root = cache / "gguf" / key
    root.mkdir(parents=True, exist_ok=True)
    out = {q: root / f"model-{q}.gguf" for q in qtypes}
    bf16 = root / "model-bf16.gguf"
    if not bf16.exists() and not all(p.exists() for p in out.values()):
        hf = root / "hf"
        shutil.rmtree(hf, ignore_errors=True)
        print(f"[llama.cpp] staging the float model for its converter in {hf} ...", flush=True)
        stage(hf)
        src = llamacpp_src(cache)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
        tmp = bf16.with_suffix(".tmp")
        print(f"[llama.cpp] convert_hf_to_gguf.py {hf} -> {bf16} ...", flush=True)
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                        "--outfile", str(tmp)], check=True, cwd=src, env=env)  # fmt: skip
        tmp.rename(bf16)
        shutil.rmtree(hf)
    for q, path in out.items():
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            print(f"[llama.cpp] llama-quantize {bf16.name} {q} ...", flush=True)
            subprocess.run([str(llamacpp_bin(cache, "llama-quantize", isa)), str(bf16), str(tmp), q], check=True,
                           stdout=subprocess.DEVNULL)  # fmt: skip
            tmp.rename(path)
    return out


# ---------------------------------------------------------------------- bytes a decode step reads


def gguf_bytes(path: Path, cache: Path) -> dict[str, Any]:
    """Bytes of a GGUF's tensors by role (the linears, the output projection = the tied embedding when
    there is no ``output.weight``, per-tensor scales, the rest; an untied input embedding, read one row
    per token, is left out of the roles), ``total`` (every tensor), and the types of the linears and of
    the output projection, read with llama.cpp's gguf-py."""
    gguf_py = str(llamacpp_src(cache) / "gguf-py")
    sys.path.insert(0, gguf_py)
    try:
        from gguf import GGUFReader
    finally:
        sys.path.remove(gguf_py)  # its tests/ would shadow the repository's tests package from here on

    roles = {"linear": 0, "output": 0, "other": 0, "scales": 0}
    types: dict[str, set[str]] = {"linear": set(), "output": set()}
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    out_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    for name, t in tensors.items():
        role = ("output" if name == out_name else "linear" if name.split(".")[-2] in LINEAR_NAMES else "other")
        if name == "token_embd.weight" and out_name != name:
            continue  # untied: the input embedding is read one row per token
        roles["scales" if name.endswith(".scale") else role] += int(t.n_bytes)
        if role in types:
            types[role].add(t.tensor_type.name)
    return dict(roles, total=sum(int(t.n_bytes) for t in tensors.values()), linear_types=sorted(types["linear"]),
                output_type=",".join(sorted(types["output"])))  # fmt: skip


def per_token_bytes(b: dict[str, Any]) -> int:
    """Bytes one decode step reads from a GGUF whose :func:`gguf_bytes` are ``b``: the linears, their
    scales and the output projection (norms and the embedding row are negligible)."""
    return b["linear"] + b["scales"] + b["output"]


def bound_tok_s(read_bw_gbs: float, nbytes: int) -> float:
    """The bytes-per-token bound: tokens/s if a decode step only read ``nbytes`` at ``read_bw_gbs`` GB/s."""
    if nbytes <= 0:
        raise ValueError(f"bound_tok_s: nbytes={nbytes} must be > 0")
    return read_bw_gbs * 1e9 / nbytes


# ---------------------------------------------------------------------- timing


# runs argv[1:] in a child forked from this small process and reports the child's peak RSS: a child spawned
# straight from the bench would inherit the bench's own high-water mark at exec (Linux keeps it in ru_maxrss)
_RSS_TRAMPOLINE = """import os, sys
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\\nAIPC_MAXRSS_KB={usage.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def peak_rss_run(cmd: list[str]) -> tuple[subprocess.CompletedProcess, int]:
    """Runs ``cmd`` and returns (the completed process, its peak resident set in bytes)."""
    proc = subprocess.run([sys.executable, "-c", _RSS_TRAMPOLINE, *cmd], capture_output=True, text=True)
    lines = proc.stderr.rstrip().splitlines()
    rss = int(lines[-1].partition("=")[2]) * 1024 if lines and lines[-1].startswith("AIPC_MAXRSS_KB=") else 0
    return subprocess.CompletedProcess(cmd, proc.returncode, proc.stdout, "\n".join(lines[:-1])), rss


def parse_llama_bench(stdout: str) -> tuple[list[float], str]:
    """(tokens/s of each repetition, the build: commit, number, CPU, backend) from the output of one
    ``llama-bench -o json`` test (one ``-p``/``-n`` pair)."""
    try:
        tests = json.loads(stdout)
    except json.JSONDecodeError as e:
        raise ValueError(f"llama-bench output is not JSON (was it run with -o json?): {stdout[:200]!r}") from e
    if not isinstance(tests, list) or len(tests) != 1 or "samples_ts" not in tests[0]:
        raise ValueError(f"llama-bench output: expected one test with samples_ts, got {str(tests)[:200]}")
    test = tests[0]
    build = (f"{test.get('build_commit', '?')} ({test.get('build_number', '?')}), {test.get('cpu_info', '?')}, "
             f"backend {test.get('backends', '?')}")  # fmt: skip
    return [float(x) for x in test["samples_ts"]], build


def llama_bench(gguf: Path, cache: Path, threads: int, prompt: int, gen: int, reps: int,
                isa: str = "native") -> tuple[list[float], str, int]:  # fmt: skip
    """``llama-bench -t threads -p prompt -n gen -r reps`` on ``gguf``: (tokens/s per repetition, the
    build, the process's peak resident bytes, the GGUF mmapped)."""
    args = ["-p", str(prompt), "-n", str(gen), "-r", str(reps)]
    proc, rss = peak_rss_run([str(llamacpp_bin(cache, "llama-bench", isa)), "-m", str(gguf), "-t", str(threads), "-o", "json",
                              *args])  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
    rates, build = parse_llama_bench(proc.stdout)
    return rates, build, rss


def run_row(gguf: Path, cache: Path, threads: int, new_tokens: int, reps: int, prompt: int, prompt_reps: int,
            isa: str = "native") -> dict:  # fmt: skip
    """One llama.cpp row: the read bandwidth on ``threads`` right before (under the same load), the
    GGUF's bytes, decode ``-p 0 -n new_tokens`` and prompt ``-p prompt -n 0`` (first token = ``prompt`` /
    its rate); tokens/s and first-token seconds per repetition, their median and best, and the peak RSS."""
    bw = read_bandwidth(threads)
    decode, build, rss_d = llama_bench(gguf, cache, threads, 0, new_tokens, reps, isa)
    prefill, _, rss_p = llama_bench(gguf, cache, threads, prompt, 0, prompt_reps, isa)
    return row_from_rates(gguf, cache, threads, bw, decode, prefill, prompt, build, max(rss_d, rss_p), isa)


def row_from_rates(gguf: Path, cache: Path, threads: int, bw: float, decode: list[float], prefill: list[float],
                   prompt: int, build: str, peak_rss: int, isa: str = "native") -> dict:  # fmt: skip
    """:func:`run_row`'s row from ``llama-bench``'s decode and ``prompt``-token prefill rates (tokens/s per
    repetition, however they were taken), the read bandwidth ``bw`` measured beside them and the peak RSS."""
    ttft = [prompt / r for r in prefill]
    return dict(model=str(gguf), threads=threads, read_bw_gbs=bw, bytes=gguf_bytes(gguf, cache), build=build, isa=isa,
                peak_rss=peak_rss, decode_tok_s_all=decode, prompt_tok_s_all=prefill,
                decode_tok_s=statistics.median(decode), decode_tok_s_best=max(decode),
                ttft_s_all=ttft, ttft_s=statistics.median(ttft), ttft_s_best=min(ttft))  # fmt: skip
