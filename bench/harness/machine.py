"""The machine block every benchmark records: CPU model, ISA features (AMX yes/no), cores and threads,
RAM, last-level cache, Python / torch versions, the native kernels' ISA and the load average."""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

# the CPU features the kernels dispatch on (as /proc/cpuinfo spells them), in the order they are reported
ISA_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def _cpuinfo() -> list[dict[str, str]]:
    """/proc/cpuinfo as one dict per logical CPU (empty where there is no such file)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return []
    cpus: list[dict[str, str]] = []
    for block in path.read_text().split("\n\n"):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        if fields:
            cpus.append({k.strip(): v.strip() for k, v in fields.items()})
    return cpus


def _llc_mib() -> int:
    """Size of the last-level cache in MiB (0 when sysfs does not say)."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        v = f.read_text().strip()
        best = max(best, int(v[:-1]) // (1024 if v.endswith("K") else 1) if v[-1] in "KM" else int(v) // 2**20)
    return best


def _ram_gib() -> float:
    """Total memory in GiB (0 when /proc/meminfo does not say)."""
    for line in Path("/proc/meminfo").read_text().splitlines() if Path("/proc/meminfo").exists() else []:
        if line.startswith("MemTotal:"):
            return round(int(line.split()[1]) / 2**20, 1)
    return 0.0


#: environment variables that force an instruction set on our kernels or on torch's (oneDNN, ATen, MKL):
#: recorded in the machine block when set
ISA_ENV = ("AIPC_ISA", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


def machine_info(**extra: Any) -> dict:
    """The machine block of a results file: CPU model name, ISA features and AMX yes/no, physical cores
    and logical threads, RAM, last-level cache, Python and torch versions, the native kernels' ISA (where
    the library is built), the ISA-forcing variables of :data:`ISA_ENV` that are set, the load average and
    date now; ``extra`` keys (a GPU, a framework version) are added as given."""
    cpus = _cpuinfo()
    first = cpus[0] if cpus else {}
    flags = set(first.get("flags", "").split())
    cores = len({(c.get("physical id"), c.get("core id")) for c in cpus if "core id" in c}) or os.cpu_count()
    info: dict[str, Any] = dict(
        cpu=first.get("model name") or platform.processor() or "unknown CPU",
        isa_features=[f for f in ISA_FEATURES if f in flags],
        amx="amx_int8" in flags,
        cores=cores,
        threads=os.cpu_count(),
        ram_gib=_ram_gib(),
        llc_mib=_llc_mib(),
        python=platform.python_version(),
    )
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        from aipc_kernels.core import native

        info["native_isa"] = native.get_isa() if native.available() else "none"
    except ImportError:
        pass
    forced = {k: os.environ[k] for k in ISA_ENV if os.environ.get(k)}
    if forced:
        info["isa_env"] = forced
    info.update(loadavg=[round(v, 2) for v in os.getloadavg()], date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    info.update(extra)
    return info


def gpu_info() -> dict:
    """The GPU keys of the machine block (CUDA device 0): name, SMs, L2, memory, CUDA and Triton versions,
    and the driver and maximum clocks as nvidia-smi reports them."""
    import subprocess

    import torch

    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = dict(gpu=torch.cuda.get_device_name(0), sms=props.multi_processor_count,
                                l2_mb=props.L2_cache_size / 2**20, gpu_mem_gb=round(props.total_memory / 2**30, 1),
                                cuda=torch.version.cuda)
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def describe(m: dict) -> str:
    """The machine block as the sentence after "Machine:" in a results file."""
    parts = [m["cpu"], f"{m['cores']} cores / {m['threads']} threads", f"{m['ram_gib']:.0f} GiB RAM",
             f"LLC {m['llc_mib']} MiB", f"AMX {'yes' if m['amx'] else 'no'} ({' '.join(m['isa_features']) or 'no AVX2'})"]
    if "native_isa" in m:
        parts.append(f"native ISA {m['native_isa']}")
    if "segment_isa" in m:
        parts.append(f"segment kernel ISA {m['segment_isa']}")
    if m.get("isa_env"):
        parts.append("ISA forced by " + " ".join(f"{k}={v}" for k, v in m["isa_env"].items()))
    parts.append(f"Python {m['python']}" + (f", torch {m['torch']}" if "torch" in m else ""))
    parts.append(f"load average {tuple(m['loadavg'])} at start, {m['date']}")
    if "gpu" not in m:
        return ", ".join(parts)
    return (f"{m['gpu']} ({m['sms']} SMs, L2 {m['l2_mb']:.0f} MiB, {m['gpu_mem_gb']} GiB), driver/clocks "
            f"{m.get('driver', '?')}, CUDA {m['cuda']}, triton {m.get('triton', '?')}; host: " + ", ".join(parts))
