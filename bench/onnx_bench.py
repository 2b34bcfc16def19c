"""ONNX Runtime (CPU) against eager PyTorch (CPU) for a Mamba language model.

    python bench/onnx_bench.py [--layers 4] [--lengths 128,512,2048] [--repeats 7]
                               [--threads N] [--scan] [--scan-dims 64,1536]
                               [--out bench/results/onnx_cpu.json]

The model: MambaLMHeadModel with the 130M model's sizes (d_model 768, d_inner 1536, d_state
16, vocab 50280) and ``--layers`` layers, random weights, float32. Its forward is exported
once with selective_scan.onnx (dynamic batch and length, traced at 2 x 16) and timed on one
row of each length; its decode step (``step``, the states as inputs and outputs) is exported
by selective_scan.onnx.decoding and timed at batch 1 and 8. ``--scan`` also times the scan
alone (batch 1, dim 1536, dstate 16) in ONNX Runtime for several chunk lengths of the
translation (1: a Scan node per step), against the eager PyTorch scan, at each
``--scan-dims`` (channels; 1536 is the 130M model's d_inner).

Times are medians of ``--repeats`` calls after two warm-up calls, eager and ONNX Runtime
calls interleaved so that a change in the machine's load hits both alike; both use
``--threads`` threads (default: every core; on a machine whose cores other processes keep busy,
one thread each is the fairer measure, and OMP_WAIT_POLICY=PASSIVE keeps torch's idle threads
from spinning). The JSON file records the CPU, core count,
date, package versions, git commit and the load average before and after.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import onnxscript
import torch
from report import cpu_model, git_commit

import selective_scan.onnx as sso
from selective_scan import MambaLMHeadModel, selective_scan_fn
from selective_scan.onnx import scan as onnx_scan
from selective_scan.onnx.decoding import Step, state_names


def interleaved(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median ms of each call over ``repeats`` rounds (each round calls each once), after two
    warm-up rounds."""
    for _ in range(2):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def rel_diff(actual: np.ndarray, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    expected = expected.numpy()
    return float(np.abs(actual - expected).max() / np.abs(expected).max())


@torch.no_grad()
def bench_lm(args: argparse.Namespace, work: Path) -> dict:
    torch.manual_seed(0)
    model = MambaLMHeadModel(
        d_model=768, n_layer=args.layers, vocab_size=50280, ssm_cfg={"d_state": 16}
    ).eval()
    start = time.perf_counter()
    dims = {0: torch.export.Dim("batch", min=2), 1: torch.export.Dim("seqlen", min=2)}
    sso.export(model, (torch.zeros(2, 16, dtype=torch.long),), work / "lm.onnx",
               dynamic_shapes={"input_ids": dims})  # fmt: skip
    forward_export_s = time.perf_counter() - start
    sess = session(work / "lm.onnx", args.threads)
    forward = {}
    for length in args.lengths:
        ids = torch.randint(0, 50280, (1, length))
        feed = {"input_ids": ids.numpy()}
        ms = interleaved(
            {"eager": lambda ids=ids: model(ids), "onnxruntime": lambda f=feed: sess.run(None, f)},
            args.repeats,
        )
        diff = rel_diff(sess.run(None, feed)[0], model(ids))
        forward[str(length)] = {**ms, "eager_over_onnxruntime": ms["eager"] / ms["onnxruntime"],
                                "max_rel_diff": diff}  # fmt: skip
        print(f"forward 1 x {length}: eager {ms['eager']:.1f} ms, ONNX Runtime "
              f"{ms['onnxruntime']:.1f} ms, rel diff {diff:.1e}", flush=True)  # fmt: skip

    names, next_names = state_names(args.layers), state_names(args.layers, "next_")
    start = time.perf_counter()
    batch = torch.export.Dim("batch", min=2)
    states = [t for pair in model.allocate_inference_cache(2) for t in pair]
    sso.export(
        Step(model), (torch.zeros(2, 1, dtype=torch.long), *states), work / "step.onnx",
        dynamic_shapes=({0: batch}, tuple({0: batch} for _ in states)),
        input_names=["input_ids", *names], output_names=["logits", *next_names],
    )  # fmt: skip
    step_export_s = time.perf_counter() - start
    step_sess = session(work / "step.onnx", args.threads)
    decode = {}
    for rows in (1, 8):
        _, cache = model.prefill(torch.randint(0, 50280, (rows, 32)))
        flat = [t for pair in cache for t in pair]
        token = torch.randint(0, 50280, (rows, 1))
        feed = {"input_ids": token.numpy()} | {
            n: t.numpy() for n, t in zip(names, flat, strict=True)
        }
        ms = interleaved(
            {
                "eager": lambda t=token, c=cache: model.step(t, c),
                "onnxruntime": lambda f=feed: step_sess.run(None, f),
            },
            args.repeats * 3,
        )
        diff = rel_diff(step_sess.run(None, feed)[0], model.step(token, cache)[0])
        decode[str(rows)] = {**ms, "eager_over_onnxruntime": ms["eager"] / ms["onnxruntime"],
                             "max_rel_diff": diff}  # fmt: skip
        print(f"decode step, batch {rows}: eager {ms['eager']:.2f} ms, ONNX Runtime "
              f"{ms['onnxruntime']:.2f} ms, rel diff {diff:.1e}", flush=True)  # fmt: skip
    return {
        "model": {"d_model": 768, "d_inner": 1536, "d_state": 16, "n_layer": args.layers,
                  "vocab": 50280, "params_M": sum(p.numel() for p in model.parameters()) / 1e6},
        "export_s": {"forward": forward_export_s, "step": step_export_s},
        "forward_batch_1": forward,
        "decode_step": decode,
    }  # fmt: skip


class _Scan(torch.nn.Module):
    def forward(self, u, delta, A, B, C, D, z, delta_bias):
        return selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)


@torch.no_grad()
def bench_scan(args: argparse.Namespace, work: Path) -> dict:
    """The scan alone at each of args.scan_dims: chunk lengths of the translation against
    eager."""
    return {str(dim): bench_scan_dim(args, work, dim) for dim in args.scan_dims}


def bench_scan_dim(args: argparse.Namespace, work: Path, dim: int) -> dict:
    dstate = 16
    gen = torch.Generator().manual_seed(0)

    def inputs(length: int) -> tuple:
        r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
        return (r(1, dim, length), 0.5 * torch.rand(1, dim, length, generator=gen),
                -(0.5 * torch.rand(dim, dstate, generator=gen) + 0.1), r(1, dstate, length),
                r(1, dstate, length), r(dim), r(1, dim, length),
                0.5 * torch.rand(dim, generator=gen))  # fmt: skip

    length_dim = torch.export.Dim("seqlen", min=2)
    per_step = {2: length_dim}
    shapes = (per_step, per_step, None, per_step, per_step, None, per_step, None)
    chunks = (1, 2, 4, 8, 16, 32)
    sessions = {}
    default = os.environ.pop(onnx_scan.CHUNK_VARIABLE, None)
    try:
        for chunk in chunks:
            os.environ[onnx_scan.CHUNK_VARIABLE] = str(chunk)
            path = work / f"scan_{dim}_{chunk}.onnx"
            sso.export(_Scan(), inputs(64), path, dynamic_shapes=shapes)
            sessions[chunk] = session(path, args.threads)
    finally:
        os.environ.pop(onnx_scan.CHUNK_VARIABLE, None)
        if default is not None:
            os.environ[onnx_scan.CHUNK_VARIABLE] = default
    model = _Scan()
    results = {}
    for length in args.scan_lengths:
        x = inputs(length)
        feed = {i.name: t.numpy() for i, t in zip(sessions[1].get_inputs(), x, strict=True)}
        calls = {"eager": lambda x=x: model(*x)}
        calls |= {f"chunk {c}": lambda s=s, f=feed: s.run(None, f) for c, s in sessions.items()}
        ms = interleaved(calls, args.repeats)
        expected = model(*x)
        diffs = {
            f"chunk {c}": rel_diff(s.run(None, feed)[0], expected) for c, s in sessions.items()
        }
        results[str(length)] = {"ms": ms, "max_rel_diff": diffs}
        print(f"scan 1 x {dim} x {length}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()),
              flush=True)  # fmt: skip
    return {"shape": {"batch": 1, "dim": dim, "dstate": dstate},
            "default_chunk": onnx_scan.chunk_length(dim, dstate), "lengths": results}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--scan", action="store_true", help="also time the scan's chunk lengths")
    parser.add_argument("--scan-lengths", default="256,1024")
    parser.add_argument("--scan-dims", default="64,1536", help="scan channels (d_inner)")
    parser.add_argument("--out", default="bench/results/onnx_cpu.json")
    args = parser.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.scan_lengths = [int(x) for x in args.scan_lengths.split(",")]
    args.scan_dims = [int(x) for x in args.scan_dims.split(",")]
    os.environ.setdefault("SELECTIVE_SCAN_BACKEND", "torch")
    torch.set_num_threads(args.threads)
    torch.exp(torch.zeros(1))  # the first exp of a torch 2.13 CPU process (see conftest.py)
    record = {
        "device": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__,
            "onnxruntime": ort.__version__,
        },
        "git_commit": git_commit(),
        "threads": args.threads,
        "timing": f"median of {args.repeats} interleaved calls after 2 warm-up calls "
        f"({3 * args.repeats} for the decode step)",
        "loadavg_before": os.getloadavg(),
        # Other processes on the cores inflate the times, multi-threaded ones most.
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset"),
        "nice": os.nice(0),
    }
    with tempfile.TemporaryDirectory() as tmp:
        record["lm"] = bench_lm(args, Path(tmp))
        if args.scan:
            record["scan"] = bench_scan(args, Path(tmp))
    record["loadavg_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
