"""Where the first torch.compile of the public forward spends its time (GPU).

    python bench/compile_time.py [--shape S1] [--dynamic] [--top 40]

Profiles (cProfile) the first call of the compiled public forward, with empty Triton and
Inductor caches, and prints its wall time and the functions with the most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import make_bench_inputs

from selective_scan import selective_scan_fn

PUBLIC_ARGS = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="S1")
    parser.add_argument("--dynamic", action="store_true")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    x = make_bench_inputs(args.shape)

    def fwd():
        return selective_scan_fn(**{k: x[k] for k in PUBLIC_ARGS})

    compiled = torch.compile(fwd, dynamic=args.dynamic, fullgraph=True)
    profile = cProfile.Profile()
    t0 = time.perf_counter()
    profile.enable()
    compiled()
    torch.cuda.synchronize()
    profile.disable()
    print(f"first call: {time.perf_counter() - t0:.1f} s (dynamic={args.dynamic})", flush=True)
    stats = pstats.Stats(profile).strip_dirs()
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(args.top // 2)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as cache:  # cold: caches of its own
        os.environ["TRITON_CACHE_DIR"] = os.path.join(cache, "triton")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache, "inductor")
        main()
