"""How much host time an eager call may take before do_bench sees it (S6's forward, GPU).

do_bench zeroes a 256 MB buffer before each timed call; while the GPU zeroes it, the host runs
ahead, so a call whose host time stays under the zeroing's time has its kernel queued before
the start event fires, and the measured time is the kernel's. This times: the zeroing; the
host time per call of the public function, its implementation and the lanes kernel's direct
launch alone; do_bench of each; and do_bench of the direct launch after a busy wait of d us
on the host (the measured time against the host time, for the budget).

    python bench/experiments/eager_host_budget.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from triton.testing import do_bench

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
from host_profile import host_us  # noqa: E402
from shapes import FWD_ARGS, make_bench_inputs  # noqa: E402

from selective_scan import selective_scan_fn  # noqa: E402
from selective_scan.kernels import launch, scan  # noqa: E402

CALLS = 300  # back-to-back calls a round of host_us (bench/host_profile.py)


def bench_us(fn) -> float:
    return 1e3 * do_bench(fn, warmup=50, rep=300, return_mode="median")


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    x = make_bench_inputs("S6")
    inputs = [x[k] for k in FWD_ARGS]
    public = {k: x[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")}

    def public_call():
        return selective_scan_fn(**public, delta_softplus=True)

    def impl_call():
        return scan.scan_fwd(*inputs)

    # The direct launch of the lanes kernel alone, with the tensors of one call.
    recorded = []
    original = launch.Launcher.__call__

    def record(self, *tensors):
        recorded.append((self, tensors))
        return original(self, *tensors)

    launch.Launcher.__call__ = record
    impl_call()
    impl_call()
    launch.Launcher.__call__ = original
    launcher, tensors = recorded[-1]

    def kernel_call():
        launcher(*tensors)

    cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int, device="cuda")
    zero_ms = []
    for _ in range(50):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        cache.zero_()
        e.record()
        torch.cuda.synchronize()
        zero_ms.append(s.elapsed_time(e))
    one = torch.zeros(1, device="cuda")
    result = {
        "launches_per_call": len(recorded) // 2,
        "zero_256MB_us": 1e3 * statistics.median(zero_ms),
        "host_us": {
            "public": host_us(public_call, CALLS),
            "implementation": host_us(impl_call, CALLS),
            "direct_launch": host_us(kernel_call, CALLS),
            "empty_cuda_tensor": host_us(lambda: torch.empty(16, device="cuda"), CALLS),
            "one_element_add": host_us(lambda: one.add_(1), CALLS),
        },
        "do_bench_us": {},
        "spin_then_launch_do_bench_us": {},
    }
    for _ in range(2):  # two rounds: the spread between them is the noise
        for name, fn in (("public", public_call), ("implementation", impl_call),
                         ("direct_launch", kernel_call),
                         ("one_element_add", lambda: one.add_(1))):  # fmt: skip
            result["do_bench_us"].setdefault(name, []).append(bench_us(fn))
        for d in (0, 10, 20, 30, 40, 50, 60, 70, 80, 100):

            def spun(d=d):
                spin(d)
                kernel_call()

            result["spin_then_launch_do_bench_us"].setdefault(str(d), []).append(bench_us(spun))
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out, "eager_host_budget.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
