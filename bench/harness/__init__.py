"""What every benchmark in bench/ shares: the machine block, the bandwidth probe, the bench lock, the
results writer, the worker-process runner and the command-line convention (``--rows``, ``--list-rows``, ``--out``, ``--name``,
``--no-lock``). The bench scripts run with bench/ on ``sys.path`` and import it as ``harness``; the
benches with llama.cpp rows also import ``harness.llamacpp`` (build, convert, quantize, time the CPU peer).
Importing it puts the repository's root on ``sys.path`` too: the benches share the tests' fixture
builders and references (``tests.helpers``, not shipped in the wheel)."""
import sys as _sys

from harness.bandwidth import gpu_copy_bandwidth, native_probes, read_bandwidth
from harness.cli import REPO_ROOT, BenchParser, select
from harness.lock import BENCH_LOCK, bench_lock
from harness.machine import describe, gpu_info, machine_info
from harness.results import command_line, markdown_table, read_results, write_results
from harness.worker import IN_PROCESS_VLLM_ENV, RESULT_PREFIX, run_worker

if REPO_ROOT not in _sys.path:
    _sys.path.append(REPO_ROOT)

__all__ = [
    "BENCH_LOCK", "BenchParser", "IN_PROCESS_VLLM_ENV", "bench_lock", "command_line", "describe", "gpu_copy_bandwidth", "gpu_info", "machine_info",
    "markdown_table", "native_probes", "read_bandwidth", "read_results", "RESULT_PREFIX", "run_worker", "select",
    "write_results",
]
