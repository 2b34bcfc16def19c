"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, and report
what costs no device time: registers, spills, shared memory, and a histogram of the SASS
instructions of each kernel (MUFU = special-function unit, SHFL = lane shuffles, LDG/STG =
global loads/stores, BAR = barriers), and of each loop's body (a backward branch's span: the
instructions a warp issues per iteration, which times the iterations bound the kernel's time at
one instruction a scheduler a cycle; design §18).

    python bench/inspect_kernels.py [--shape S1] [--dtype bf16] [--seqlen 256] [--out DIR]

The launchers run on CPU tensors of the requested shape with ``wrap_triton`` swapped for a
recorder, so the kernels are specialised exactly as on the GPU (dtypes, constexprs, 16-byte
divisibility of pointers and strides).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import SHAPES, make_bench_inputs

from selective_scan.kernels.offline import compile_sm90, scan_launches
from selective_scan.kernels.tiles import DEFAULT_POLICY, use_policy

# "/*0a10*/ @!P0 FFMA R1, ..." -> address, opcode (after an optional predicate)
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")


def disassemble(cubin: bytes, path: Path) -> str:
    """The cubin's SASS (nvdisasm), also written next to it."""
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    path.write_bytes(cubin)
    text = subprocess.run([str(nvdisasm), "-c", str(path)], capture_output=True, text=True).stdout
    path.with_suffix(".sass").write_text(text)
    return text


def sass_histogram(text: str) -> collections.Counter:
    return collections.Counter(op for _, op, _ in INSTRUCTION.findall(text))


def loop_bodies(text: str) -> list[tuple[int, int, collections.Counter]]:
    """(first address, last address, opcode histogram) of each backward branch's span, in
    address order: a loop's body as the warp issues it once per iteration."""
    labels, pending, code = {}, [], []
    for line in text.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        found = INSTRUCTION.search(line)
        if found:
            address = int(found.group(1), 16)
            labels.update((name, address) for name in pending)
            pending = []
            code.append((address, found.group(2), found.group(3)))
    loops = []
    for address, op, operands in code:
        target = re.search(r"\.?(L_x_\d+)", operands) if op == "BRA" else None
        start = labels.get(target.group(1)) if target else None
        if start is not None and start < address:
            body = collections.Counter(o for a, o, _ in code if start <= a <= address)
            loops.append((start, address, body))
    return sorted(loops)


def resource_usage(cubin: Path) -> str:
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    text = subprocess.run(
        [str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True
    ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    return "regs={} stack={} shared={} local={}".format(*found.groups()) if found else text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="S1", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default=None, help="override the shape's dtype")
    parser.add_argument("--out", default="/tmp/selective_scan_sass")
    parser.add_argument("--tiles", default="", help="config overrides, e.g. NS=4,num_warps=2")
    parser.add_argument(
        "--seqlen", type=int, default=256, help="the code depends on its divisibility only"
    )
    args = parser.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    overrides = {k: int(v) for k, v in (kv.split("=") for kv in args.tiles.split(",") if kv)}
    policy = DEFAULT_POLICY.replace(fwd_overrides=overrides, bwd_overrides=overrides)
    inputs = make_bench_inputs(args.shape, device="cpu", dtype=args.dtype, small_seqlen=args.seqlen)

    softplus = inputs.pop("delta_softplus")
    with use_policy(policy):
        launches = scan_launches(inputs, softplus)
    for k, (kernel, grid, kkwargs, _) in enumerate(launches):
        compiled = compile_sm90(kernel, kkwargs)
        md = compiled.metadata
        name = f"{k}{kernel.__name__}"  # the ranges' local pass and the main one share a kernel
        sass = disassemble(compiled.asm["cubin"], out_dir / f"{name}.cubin")
        hist = sass_histogram(sass)
        (out_dir / f"{name}.ttgir").write_text(compiled.asm["ttgir"])
        (out_dir / f"{name}.ptx").write_text(compiled.asm["ptx"])
        print(
            f"{name} (LOCAL={kkwargs.get('LOCAL')}): warps={md.num_warps} shared={md.shared} "
            f"grid={grid} {resource_usage(out_dir / f'{name}.cubin')}"
        )
        top = ", ".join(f"{op}:{n}" for op, n in hist.most_common(40))
        print(f"  SASS ({sum(hist.values())} instructions): {top}")
        for start, end, body in loop_bodies(sass):
            top = ", ".join(f"{op}:{n}" for op, n in body.most_common(12))
            print(f"  loop {start:#06x}-{end:#06x} ({sum(body.values())} instructions): {top}")
    print(f"cubin/sass/ttgir/ptx written to {out_dir}")


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "0")
    main()
