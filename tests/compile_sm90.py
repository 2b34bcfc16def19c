"""Compile the scan kernels for sm_90 at the configurations given as JSON (make_inputs
arguments, dtype by name): prints one line per configuration, exits 1 if any failed. A
configuration also fails when a kernel scans (tl.associative_scan, tl.cumsum) a tensor whose
layout replicates values over lanes, or when a tile kernel's scan along time crosses lanes
(see scan_layout_faults).

Run by test_sm90_compile.py in a process of its own: the compiler needs the real @triton.jit
kernels, and the test session decorates them for the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import json
import re
import sys

import torch
from helpers import make_inputs

from selective_scan.kernels.offline import compile_sm90, scan_launches

LAYOUT = re.compile(r"^(#blocked\d*) = #ttg\.blocked<\{(.*?)\}>", re.M)
SCAN = re.compile(r'"tt\.scan".*?axis = (\d+).*?\}\) : \(tensor<([\dx]+)x\w+, (#blocked\d*)>', re.S)


def scan_layout_faults(ttgir: str, time_in_thread: bool) -> list[str]:
    """The scans of a kernel's TTGIR that run across lanes on a layout that replicates values
    over lanes (more lanes along an axis than the tensor has elements there): Triton's scan
    lowering gave wrong results on one on the H200 (a [2, 1, 8] cumsum over lanes [4, 2, 4],
    the time axis across 4 lanes); in-thread scans of replicated values are right. With
    ``time_in_thread`` (the tile kernels, whose time axis is the scan axis, see common.py)
    every scan across lanes."""
    layouts = {}
    for name, body in LAYOUT.findall(ttgir):
        fields = dict(re.findall(r"(\w+) = \[([\d, ]*)\]", body))
        layouts[name] = {k: [int(v) for v in fields[k].split(",")] for k in
                         ("sizePerThread", "threadsPerWarp", "warpsPerCTA")}  # fmt: skip
    faults = []
    for axis, shape, name in SCAN.findall(ttgir):
        dims = [int(v) for v in shape.split("x")]
        lay = layouts[name]
        lanes = lay["threadsPerWarp"][int(axis)] * lay["warpsPerCTA"][int(axis)]
        spans = [s * t * w for s, t, w in
                 zip(lay["sizePerThread"], lay["threadsPerWarp"], lay["warpsPerCTA"],
                     strict=True)]  # fmt: skip
        replicated = any(span > size for span, size in zip(spans, dims, strict=True))
        if lanes > 1 and (replicated or time_in_thread):
            faults.append(f"scan {shape} along axis {axis} across lanes {lay}")
    return faults


def compile_case(case: dict) -> list[str]:
    """Compile every launch of a forward and a backward of the case; the kernels' names.
    Raises if a kernel's scans are laid out as scan_layout_faults rejects."""
    kwargs = dict(case, dtype=getattr(torch, case["dtype"]), device="cpu")
    inputs = make_inputs(**kwargs)
    names = []
    for kernel, _, args, kwargs in scan_launches(inputs, delta_softplus=True):
        compiled = compile_sm90(kernel, args, kwargs)
        local = f"(LOCAL={kwargs['LOCAL']})" if "LOCAL" in kwargs else ""
        name = kernel.__name__ + local
        tile_kernel = kernel.__name__ in ("_scan_fwd_kernel", "_scan_bwd_kernel")
        faults = scan_layout_faults(compiled.asm["ttgir"], time_in_thread=tile_kernel)
        if faults:
            raise AssertionError(f"{name}: {'; '.join(faults)}")
        names.append(name)
    return names


def main() -> int:
    failed = 0
    for case in json.loads(sys.argv[1]):
        try:
            print("ok", case, *compile_case(case), flush=True)
        except Exception as e:  # report every case, then fail
            failed += 1
            print("FAIL", case, type(e).__name__, str(e).splitlines()[0][:300], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
