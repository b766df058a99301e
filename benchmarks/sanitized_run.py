"""Runs ``long_run.py`` on N gloo ranks with every rank under a memory checker: the heap-corruption check.

    python benchmarks/sanitized_run.py --tool asan -- --system zerocc-3+pools --steps 100
    python benchmarks/sanitized_run.py --tool valgrind -- --system zerocc-3 --steps 3 --tiny
    python benchmarks/sanitized_run.py --tool asan --pytest -- tests/test_inflight_work.py -p no:xdist

Arguments after ``--`` go to ``long_run.py``, or with ``--pytest`` to one ``python -m pytest`` run under the
checker (ASan only): the test ranks are forked from it (``tests/distributed.py``), so they carry the preloaded
allocator and its options too; each process writes ``asan.pytest.log.<pid>`` into ``--logs`` if it finds an
error.

Without ``--pytest`` each rank is started here (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` set as torchrun sets them) so that the checker wraps the rank's Python itself:

- ``asan``: AddressSanitizer's allocator preloaded (``LD_PRELOAD`` of libasan). Python and torch are not
  instrumented, so ASan sees what passes through its interceptors: every malloc/free (double and invalid
  frees abort) and the libc calls it wraps (memcpy, memset, read, write, recv, send...) touching freed,
  quarantined memory. A plain load or store in uninstrumented code (an aten kernel) is not checked, but the
  quarantine keeps freed blocks from being reused for a while, so such a write cannot land in a live block.
- ``valgrind``: memcheck emulates every instruction, so it reports invalid reads and writes anywhere,
  uninstrumented code included. Use ``--tiny`` and a few steps: a step is about a hundred times slower.
  Uninitialised-value checks are off (noise from Python and BLAS); ``valgrind.supp`` hides the dynamic
  loader's known false positive.

``PYTHONMALLOC=malloc`` puts Python's own objects through the checked allocator too. A rank's report goes to
``<--logs>/<tool>.rank<N>.log``; the exit status is the first failing rank's (99: valgrind found errors).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
# libstdc++ loaded at start: ASan resolves the real __cxa_throw then (python itself does not link it).
LIBASAN = "/usr/lib/x86_64-linux-gnu/libasan.so.8:/usr/lib/x86_64-linux-gnu/libstdc++.so.6"
# detect_leaks: Python and torch never free some globals; allocator_may_return_null: torch probes with large
# allocations; verify_asan_link_order: libasan is preloaded into an uninstrumented python.
ASAN_OPTIONS = "detect_leaks=0:halt_on_error=1:allocator_may_return_null=1:verify_asan_link_order=0"
VALGRIND = ["valgrind", "--tool=memcheck", "--error-exitcode=99", "--undef-value-errors=no",
            "--suppressions=/usr/lib/valgrind/python3.supp", f"--suppressions={HERE}/valgrind.supp", "--num-callers=30"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool", choices=("asan", "valgrind", "none"), required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--logs", default=".", help="folder for each rank's checker report")
    parser.add_argument("--pytest", action="store_true", help="run pytest with the arguments after -- (asan only)")
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    os.makedirs(args.logs, exist_ok=True)
    if args.pytest:
        if args.tool != "asan":
            raise SystemExit("--pytest: only with --tool asan (valgrind would run the whole suite emulated)")
        log = os.path.join(os.path.abspath(args.logs), "asan.pytest.log")
        env = dict(os.environ, PYTHONMALLOC="malloc", LD_PRELOAD=LIBASAN, ASAN_OPTIONS=f"{ASAN_OPTIONS}:log_path={log}")
        code = subprocess.run([sys.executable, "-m", "pytest", *rest], env=env).returncode
        print(f"asan: pytest exit code {code}, reports (if any) in {log}.<pid>", flush=True)
        sys.exit(code)
    port = _free_port()
    ranks = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONMALLOC="malloc", OMP_NUM_THREADS="1")
        log = os.path.join(args.logs, f"{args.tool}.rank{rank}.log")
        command = [sys.executable, os.path.join(HERE, "long_run.py"), *rest]
        if args.tool == "asan":
            env.update(LD_PRELOAD=LIBASAN, ASAN_OPTIONS=f"{ASAN_OPTIONS}:log_path={log}")
        elif args.tool == "valgrind":
            command = [*VALGRIND, f"--log-file={log}", *command]
        ranks.append(subprocess.Popen(command, env=env))
    codes = [r.wait() for r in ranks]
    print(f"{args.tool}: rank exit codes {codes}, reports in {args.logs}", flush=True)
    sys.exit(next((c for c in codes if c), 0))


if __name__ == "__main__":
    main()
