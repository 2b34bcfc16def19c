"""Compile the scan kernels for sm_90 at the configurations given as JSON (make_inputs
arguments, dtype by name): prints one line per configuration, exits 1 if any failed.

Run by test_sm90_compile.py in a process of its own: the compiler needs the real @triton.jit
kernels, and the test session decorates them for the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import json
import sys

import torch
from helpers import make_inputs

from selective_scan.kernels.offline import compile_sm90, scan_launches


def compile_case(case: dict) -> list[str]:
    """Compile every launch of a forward and a backward of the case; the kernels' names."""
    kwargs = dict(case, dtype=getattr(torch, case["dtype"]), device="cpu")
    inputs = make_inputs(**kwargs)
    names = []
    for kernel, _, args, kwargs in scan_launches(inputs, delta_softplus=True):
        compile_sm90(kernel, args, kwargs)
        local = f"(LOCAL={kwargs['LOCAL']})" if "LOCAL" in kwargs else ""
        names.append(kernel.__name__ + local)
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
