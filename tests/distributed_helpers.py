"""Multi-process tests on CPU with gloo: a launcher of worker functions, and comparisons.

``run_workers(file, "name", nprocs, **kwargs)`` starts nprocs Python processes, each running
``name(**kwargs)`` of the test file ``file`` after joining a gloo process group on a free port
of its own (so that tests running at the same time, under pytest-xdist, never share one). A
worker fails by raising; the launcher then fails the test with every rank's output. Workers are
plain subprocesses (not multiprocessing.spawn): nothing depends on how pytest or xdist started
the parent process.

Run as a script, this file is the worker: ``python distributed_helpers.py FILE NAME JSON``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

# Single-threaded workers: the CPU is shared by the ranks of a test and by other tests.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "SELECTIVE_SCAN_BACKEND": "torch"}


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(file: str, name: str, nprocs: int, timeout: float = 240, **kwargs) -> None:
    """Run ``name(**kwargs)`` of test file ``file`` on nprocs gloo ranks; raise AssertionError
    with the ranks' output unless every rank exits cleanly within timeout seconds."""
    port = free_port()
    env = {**os.environ, **WORKER_ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(nprocs)}  # fmt: skip
    env.pop("TRITON_INTERPRET", None)  # the workers run the torch backend only
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(Path(file).resolve()), name, json.dumps(kwargs)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(nprocs)
    ]
    outputs, failed = [], False
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            out += f"\n[rank {rank} killed after {timeout} s]"
        failed |= proc.returncode != 0
        outputs.append(f"--- rank {rank} (exit {proc.returncode}) ---\n{out[-6000:]}")
    if failed:
        raise AssertionError(f"{name} failed on {nprocs} ranks:\n" + "\n".join(outputs))


def _worker_main(file: str, name: str, kwargs: str) -> None:
    import torch
    import torch.distributed as dist

    torch.exp(torch.zeros(1))  # see conftest's _exact_first_exp
    tests_dir = str(Path(file).parent)
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    spec = importlib.util.spec_from_file_location(Path(file).stem, file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dist.init_process_group("gloo")
    try:
        getattr(module, name)(**json.loads(kwargs))
    finally:
        dist.destroy_process_group()
    # Done: exit without the interpreter's finalization. torch may still hold the default group
    # that destroy_process_group let go (DTensor's caches keep a DeviceMesh and its groups;
    # torch.distributed.nn's default arguments keep the group when it is first imported after
    # init_process_group, as selective_scan's import of torch._inductor does), so its gloo
    # threads live on; finalization would free it, and one still releasing the last
    # collective's tensors would take the GIL there and abort the process ("terminate called
    # without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_close(actual, expected, name: str, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """torch.testing.assert_close naming the compared quantity and the rank."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"rank {rank}, {name}: {m}"
    )


if __name__ == "__main__":
    _worker_main(*sys.argv[1:4])
