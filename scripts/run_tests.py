"""Runs the whole test suite: each plugin's tests in its own venv, the kernel layer's once.

    python3 scripts/run_tests.py                 # all environments
    python3 scripts/run_tests.py --env vllm      # one environment
    python3 scripts/run_tests.py -- -k lowbit    # extra pytest arguments after --
    python3 scripts/run_tests.py --envs-only     # build (or check) the venvs, run no test

Venvs are built on first use and reused while their inputs are unchanged (scripts/envs.py).
In each venv the folders of its ``parallel`` list run first, spread over the machine's cores by
pytest-xdist (``AIPC_TEST_WORKERS``, default: the CPU count, at most 4; 1 runs them in-process): the
smoke test of the installed kernel layer everywhere, the kernel layer's whole suite in
``envs.KERNEL_ENV`` only. Then the plugin's folder in one process (its tests start servers and
subprocesses of their own).
Prints a timing summary and a combined ``N passed, N failed`` line; exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import envs  # noqa: E402


def _counts(junit: Path) -> dict[str, int]:
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if not junit.exists():
        return total
    root = ET.parse(junit).getroot()
    for suite in root.iter("testsuite"):
        for k in total:
            total[k] += int(suite.get(k, 0))
    return total


def _workers() -> int:
    """pytest-xdist workers for the kernel layer's tests: ``AIPC_TEST_WORKERS`` or the CPU count (max 4)."""
    raw = os.environ.get("AIPC_TEST_WORKERS")
    if raw is None:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    if not raw.isdigit() or int(raw) < 1:
        raise SystemExit(f"AIPC_TEST_WORKERS={raw!r}: give a whole number >= 1 (1: no xdist workers)")
    return int(raw)


def _present(folders: tuple[str, ...]) -> list[str]:
    """The test folders of ``folders`` that exist in this checkout."""
    return [t for t in folders if (envs.ROOT / t).is_dir()]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", action="append", choices=sorted(envs.ENVS), help="only these environments")
    ap.add_argument("--envs-only", action="store_true", help="build or reuse the venvs, run no test")
    args = ap.parse_args(argv)

    workers = _workers()
    timings: dict[str, float] = {}
    results: dict[str, dict[str, int]] = {}
    codes: dict[str, int] = {}
    t_all = time.time()
    for name in args.env or list(envs.ENVS):
        spec = envs.ENVS[name]
        try:
            py = envs.ensure_env(spec, timings)
        except RuntimeError as e:
            print(f"[tests] environment '{name}' could not be built:\n{e}", flush=True)
            codes[name] = 2
            continue
        if args.envs_only:
            codes[name] = 0
            continue
        runs = [(f"{name}-parallel", _present(spec.parallel), ["-n", str(workers)] if workers > 1 else []),
                (name, _present(spec.tests), [])]
        env = dict(os.environ, **spec.env, PYTHONDONTWRITEBYTECODE="1")
        collected, code = False, 0
        for run, paths, xdist in runs:
            if not paths:
                continue
            junit = envs.VENVS / f"{run}.junit.xml"
            junit.unlink(missing_ok=True)
            print(f"[tests] {run}: pytest {' '.join(xdist + paths)}", flush=True)
            t0 = time.time()
            proc = subprocess.run(
                [str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                 *xdist, *paths, *extra],
                cwd=envs.ROOT,
                env=env,
            )
            timings[f"tests {run}"] = time.time() - t0
            counts = _counts(junit)
            results[name] = {k: results.get(name, {}).get(k, 0) + v for k, v in counts.items()}
            # pytest exit 5 = nothing collected: fine for one run of a filtered (-k) suite, a
            # failure when the environment's runs together collected nothing
            collected |= proc.returncode != 5
            code = code or (proc.returncode if proc.returncode != 5 else 0)
        codes[name] = code if collected else 5

    print("\n[tests] timing summary")
    for k, v in timings.items():
        print(f"  {k:40s} {v:7.1f} s")
    print(f"  {'total':40s} {time.time() - t_all:7.1f} s")
    if args.envs_only:
        print(f"\n[tests] venvs ready: {', '.join(sorted(n for n, c in codes.items() if c == 0)) or 'none'}")
        return 0 if codes and all(c == 0 for c in codes.values()) else 1
    passed = failed = skipped = 0
    for name, c in results.items():
        f = c["failures"] + c["errors"]
        p = c["tests"] - f - c["skipped"]
        passed, failed, skipped = passed + p, failed + f, skipped + c["skipped"]
        print(f"  {name:12s} {p} passed, {f} failed, {c['skipped']} skipped (pytest exit {codes[name]})")
    failed += sum(1 for n, c in codes.items() if n not in results)
    print(f"\n{passed} passed, {failed} failed, {skipped} skipped")
    return 0 if codes and all(c == 0 for c in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
