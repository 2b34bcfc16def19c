"""GPU time of the backward's partial-sum launch (kernels/grad_sums.py) at benchmark shapes, for
other tiles of its variable dB/dC jobs: BM_STEPS (sums a program takes), ELEMENTS (partials a
load) and num_warps; and, in the same process, the torch reductions it replaced (the code before
session 27: each partial summed over its programs or blocks by ``Tensor.sum``, then copied into
a fresh tensor of its input's shape). The partials are those a real backward wrote; each
variant's outputs are checked against the default's. do_bench medians of the launch alone
(about 4 us of do_bench's own on top, bench/NOTES.md session 26).

    python bench/experiments/grad_sums_tiles.py --shapes S1,S2,S6,S7 [--bms 256,1024]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path
from unittest import mock

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shapes import FWD_ARGS, make_bench_inputs

from selective_scan.kernels import scan
from selective_scan.kernels.grad_sums import _grad_sums_kernel

OPS = torch.ops.selective_scan


def recorded_launch(shape: str) -> tuple:
    """(plan, A, B, C, D, delta_bias, tensors) of the shape's backward's grad_sums launch."""
    x = make_bench_inputs(shape)
    inputs = [x[k] for k in FWD_ARGS[:-1]]
    out, _, ckpt = OPS.scan_fwd_triton(*inputs, True)
    seen = []
    real = scan._launch_kernel

    def record(launchers, kernel, grid, tensors, args, options, key):
        real(None, kernel, grid, tensors, args, options, key)
        if kernel is _grad_sums_kernel:
            seen.append(tensors)

    with mock.patch.object(scan, "_launch_kernel", record):
        scan.scan_bwd(torch.randn_like(out), None, *inputs, ckpt, True)
    p = scan.plan(scan.bwd_config, *inputs)
    return p, x["A"], x["B"], x["C"], x["D"], x["delta_bias"], seen[0]


def launch(p, B, C, D, bias, bm: int, elements: int, warps: int):
    steps_M = scan.bc_tiles(p.seqlen, p.cfg["T"]) * p.NP * p.cfg["T"]
    tile = scan.grad_sum_tile

    def steps_tile(rows, M):
        return bm if steps_M == M else tile(rows, M)

    with mock.patch.object(scan, "grad_sum_tile", steps_tile):
        grid, args, options = scan.grad_sums_launch(p, B, C, D, bias)
    options = options | {"ELEMENTS": elements, "num_warps": warps}
    return lambda tensors: _grad_sums_kernel[grid](*tensors, *args, **options)


def torch_sums(p, parts: tuple, inputs: tuple) -> list:
    """The reductions grad_sums replaced, as that code ran them at large sizes (it summed S6's
    many blocks in two stages, not reproduced here)."""
    outs = []
    for part, t in zip(parts, inputs, strict=True):
        if t is None:
            continue
        out = t.new_empty(t.shape)
        if t.dim() < 3:  # over programs: (programs, dim[, NP])
            summed = part.sum(0)
            out.copy_(summed if t.dim() == 1 else summed[:, : p.dstate])
        else:
            batch, blocks, tiles, NP, T = part.shape
            groups = 1 if t.dim() == 3 else t.shape[1]
            summed = part.view(batch, groups, blocks // groups, tiles, NP, T).sum(2)
            rows = out.view(batch, groups, p.dstate, tiles, T)  # seqlen a multiple of T here
            rows.copy_(summed.transpose(2, 3)[:, :, : p.dstate])
        outs.append(out)
    return outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="S1,S2,S6,S7")
    parser.add_argument("--bms", default="16,64,256,1024,2048")
    parser.add_argument("--elements", default="4096,8192")
    parser.add_argument("--warps", default="4,8")
    args = parser.parse_args()

    def ints(text):
        return [int(v) for v in text.split(",")]

    for shape in args.shapes.split(","):
        p, A, B, C, D, bias, tensors = recorded_launch(shape)
        parts, outs = tensors[0::2], tensors[1::2]
        want = [t.clone() for t in outs]
        inputs = (A, B, C, D, bias)
        base = torch_sums(p, parts, inputs)
        same = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)
                   for a, b in zip(base, want, strict=True))  # fmt: skip
        us = 1e3 * do_bench(functools.partial(torch_sums, p, parts, inputs), warmup=50, rep=200)
        print(f"{shape} torch reductions: {us:8.1f} us  match {same}", flush=True)
        default = scan.grad_sums_launch(p, B, C, D, bias)[2]["BM_STEPS"]
        variants = itertools.product(ints(args.bms), ints(args.elements), ints(args.warps))
        for bm, elements, warps in variants:
            if elements // bm < 1:
                continue
            run = launch(p, B, C, D, bias, bm, elements, warps)
            for t in outs:
                t.fill_(float("nan"))
            run(tensors)
            same = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3)
                       for a, b in zip(outs, want, strict=True))  # fmt: skip
            us = 1e3 * do_bench(lambda run=run, t=tensors: run(t), warmup=50, rep=200)
            mark = "  (default)" if (bm, elements, warps) == (default, 4096, 4) else ""
            print(
                f"{shape} BM_STEPS {bm:5d} ELEMENTS {elements:5d} warps {warps}: "
                f"{us:8.1f} us  match {same}{mark}",
                flush=True,
            )


if __name__ == "__main__":
    main()
