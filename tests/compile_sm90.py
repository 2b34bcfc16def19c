"""Compile the scan kernels for sm_90 at the configurations given as JSON (make_inputs
arguments, or with "complex": true test_complex's complex_inputs arguments; dtype by name):
prints one line per configuration, exits 1 if any failed. A configuration also fails when a
kernel scans (tl.associative_scan, tl.cumsum) a tensor whose layout Triton got wrong on the
H200 (see scan_layout_faults), with 16 states, when a tile kernel's PTX adds +0.0 (see
ZERO_ADDITION), when a real kernel's recurrence multiplies its carried value before adding
it (see multiplied_carries), and when the backward's full pass stores its scratch without an L2
evict_last policy (design §5).

Run by test_sm90_compile.py in a process of its own: the compiler needs the real @triton.jit
kernels, and the test session decorates them for the interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import json
import re
import sys

import torch
from helpers import complex_inputs, make_inputs

from selective_scan.cpu import CHUNK
from selective_scan.kernels import complex_scan
from selective_scan.kernels.offline import compile_sm90, record_launches, scan_launches
from selective_scan.scan_args import ScanArgs

LAYOUT = re.compile(r"^(#blocked\d*) = #ttg\.blocked<\{(.*?)\}>", re.M)
SCAN = re.compile(r'"tt\.scan".*?axis = (\d+).*?\}\) : \(tensor<([\dx]+)x\w+, (#blocked\d*)>', re.S)
# x + 0.0, which the compiler may not fold (it is +0.0 where x is -0.0): left by an in-thread
# sum that takes +0.0 for the identity, as common.pick did with a literal -0.0 (Triton stores
# it as +0.0), one wasted instruction a pick (about 7% of the backward's tile walk). Checked on
# cases of 16 states: where a thread's states are padding, a sum across lanes may add a known
# +0.0 once a program, which costs nothing.
ZERO_ADDITION = re.compile(r"\badd(?:\.rn)?\.f(?:32|64)\s+%\w+, %\w+, 0[fd]0+;")
TILE_KERNELS = ("_scan_fwd_kernel", "_scan_bwd_kernel")
FLOAT_OP = re.compile(r"^\s*(mul|fma)\.(?:rn\.)?f(?:32|64)\s+(%\w+),\s*([^;]+);", re.M)


def scan_layout_faults(ttgir: str) -> list[str]:
    """The scans of a kernel's TTGIR laid out as the one Triton's scan lowering got wrong on
    the H200: the scan axis across lanes with each thread holding elements of it that are not
    contiguous (the layout wraps around the axis), on a layout that replicates values over
    other lanes (more lanes along an axis than the tensor has elements there). That was a
    [2, 1, 8] cumsum over lanes [4, 2, 4], one element a thread, in the backward's local pass
    of 2-row tiles. In-thread scans, and scans across lanes that do not wrap or replicate, ran
    right on the H200 (tile layouts of 16-bit inputs; 256 states; the range entries)."""
    layouts = {}
    for name, body in LAYOUT.findall(ttgir):
        fields = dict(re.findall(r"(\w+) = \[([\d, ]*)\]", body))
        layouts[name] = {k: [int(v) for v in fields[k].split(",")] for k in
                         ("sizePerThread", "threadsPerWarp", "warpsPerCTA")}  # fmt: skip
    faults = []
    for axis, shape, name in SCAN.findall(ttgir):
        dims = [int(v) for v in shape.split("x")]
        lay = layouts[name]
        spans = [s * t * w for s, t, w in
                 zip(lay["sizePerThread"], lay["threadsPerWarp"], lay["warpsPerCTA"],
                     strict=True)]  # fmt: skip
        a = int(axis)
        across = lay["threadsPerWarp"][a] * lay["warpsPerCTA"][a] > 1
        wraps = spans[a] < dims[a]
        replicated = any(span > size for span, size in zip(spans, dims, strict=True))
        if across and wraps and replicated:
            faults.append(f"scan {shape} along axis {axis} over {lay}")
    return faults


def multiplied_carries(ptx: str) -> int:
    """Steps h' = fma(u, v, a * h) of a recurrence h' = a h + x with x = u v: two dependent
    instructions a step where fma(a, h, x) takes one. LLVM contracts `a * h + u * v` either
    way, and took this one in every scan until common.combine and reverse_recurrence called
    tl.fma (design §3). Counts such steps that follow another."""
    defs = {d: (op, [a.strip() for a in args.split(",")]) for op, d, args in FLOAT_OP.findall(ptx)}

    def carry(reg):  # the h of reg = fma(u, v, a * h), h itself an fma; else None
        op, args = defs.get(reg, ("", []))
        product = defs.get(args[2]) if op == "fma" else None
        if product and product[0] == "mul":
            return next((h for h in product[1] if defs.get(h, ("",))[0] == "fma"), None)
        return None

    return sum(1 for reg in defs if (h := carry(reg)) is not None and carry(h) is not None)


def complex_launches(case: dict) -> list[tuple]:
    """The launches of a forward and a backward of the complex kernels (kernels/complex_scan.py)
    on test_complex's inputs (complex_inputs arguments; dtype by name)."""
    x = complex_inputs(**dict(case, dtype=getattr(torch, case["dtype"]), device="cpu"))
    args = ScanArgs(**x, cu_seqlens=None, delta_softplus=True)

    def both_directions():
        out, last, checkpoints = complex_scan.scan_fwd(args, CHUNK)
        complex_scan.scan_bwd(torch.randn_like(out), torch.randn_like(last), args, checkpoints,
                              CHUNK)  # fmt: skip

    return record_launches(both_directions)


def compile_case(case: dict) -> list[str]:
    """Compile every launch of a forward and a backward of the case (complex A where it says
    "complex"); the kernels' names. Raises on any fault the module docstring lists."""
    case = dict(case)
    check_sums = case.get("dstate") == 16
    real = not case.pop("complex", False)  # complex steps multiply their carry by definition
    if not real:
        launches = complex_launches(case)
    else:
        inputs = make_inputs(**dict(case, dtype=getattr(torch, case["dtype"]), device="cpu"))
        launches = scan_launches(inputs, delta_softplus=True)
    names = []
    for kernel, _, kwargs, _ in launches:
        compiled = compile_sm90(kernel, kwargs)
        local = f"(LOCAL={kwargs['LOCAL']})" if "LOCAL" in kwargs else ""
        name = kernel.__name__ + local
        faults = scan_layout_faults(compiled.asm["ttgir"])
        ptx = compiled.asm["ptx"]
        if check_sums and kernel.__name__ in TILE_KERNELS and ZERO_ADDITION.search(ptx):
            faults.append(f"adds +0.0 {len(ZERO_ADDITION.findall(ptx))} times")
        if real and (steps := multiplied_carries(ptx)):
            faults.append(f"multiplies the carry before adding it in {steps} steps")
        full_bwd = kernel.__name__ == "_scan_bwd_kernel" and not kwargs["LOCAL"]
        if full_bwd and "L2::evict_last" not in ptx:
            faults.append("stores its scratch without an L2 evict_last policy")
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
