"""Train a small Mamba LM on selective copying, export it, and check every artifact against it.

    python -m selective_scan.apps.copying                # CPU preset: minutes on 2 cores
    python -m selective_scan.apps.copying --device cuda  # GPU preset: longer rows, more symbols
    python -m selective_scan.apps.copying --steps 40 --seqlen 16 --out /tmp/copying

In one command: trains ``MambaLMHeadModel`` on the selective-copying task (copying_task.py) on
batches generated on the fly from a seeded generator, through a training step compiled with
``torch.compile(fullgraph=True)`` and a progress bar of step, loss and answer accuracy
(copying_train.py); exports its forward with ``torch.export`` (dynamic batch and length), saves
it and loads it back, and compiles, saves and loads an AOTInductor package; runs the eager
model, a compiled forward and both loaded artifacts on one held-out batch (max |logit
difference| from eager, answer accuracy, tokens/s); decodes a few held-out prompts greedily with
``generate`` (prefill, then one step per token) and with each artifact (the full forward once
per token). With CUDA it also times a decode step replayed as a CUDA graph. ``--no-aoti`` skips
the package, where loading AOTInductor libraries is broken (as on one torch 2.11 CUDA image).
The forward is also exported to ONNX (selective_scan.onnx) and run in ONNX Runtime on CPU like
the other artifacts; without the onnx packages (``pip install -e ".[onnx]"``) that is skipped.

Exits 1 when the held-out answer accuracy is below --min-accuracy, a forward differs from eager
by more than --tolerance, or a greedy answer differs from generate's.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from torch import Tensor

from ..models import MambaLMHeadModel
from . import device_from
from .copying_task import MARKER, SelectiveCopying, as_text
from .copying_train import PRESETS, Settings, build_model, train
from .demo import time_call

Forward = Callable[[Tensor], Tensor]  # input_ids (batch, seqlen) -> logits (batch, seqlen, vocab)

HELD_OUT_SEED_OFFSET = 1_000_003  # held-out rows come from another stream than training's


@dataclass
class Row:
    """One forward run on the held-out batch, compared with the eager model."""

    mode: str
    build_s: float  # compile / export + save + load / package + load; 0 for eager
    ms: float  # median time per call
    tokens_per_s: float
    max_diff: float  # max |logits - eager logits|; 0 for eager
    accuracy: float  # answer-token accuracy from its own logits
    ok: bool


# Smallest length the exported forward takes (every prompt here is longer). Sizes 0 and 1
# specialize everywhere. Export on CUDA once failed on a guard ceil(seqlen / 4) != 1 from the
# Triton launcher's B/C blocking; kernels/layout.py's bc_tiles removed it, and 16 keeps a margin
# until a GPU run confirms that.
MIN_EXPORT_SEQLEN = 16


def export_forward(model: MambaLMHeadModel, example: Tensor) -> torch.export.ExportedProgram:
    """torch.export of model.forward with dynamic batch (from 2 up: sizes 0 and 1 would
    specialize) and length (from MIN_EXPORT_SEQLEN up); example: input_ids (batch, seqlen)."""
    dims = {
        0: torch.export.Dim("batch", min=2),
        1: torch.export.Dim("seqlen", min=MIN_EXPORT_SEQLEN),
    }
    return torch.export.export(model, (example,), dynamic_shapes={"input_ids": dims})


def greedy_answers(forward: Forward, prompt: Tensor, num_tokens: int) -> Tensor:
    """Greedy decoding with a full forward per new token (what an exported forward offers):
    prompt (batch, seqlen) -> the num_tokens generated tokens (batch, num_tokens)."""
    rows = prompt
    for _ in range(num_tokens):
        rows = torch.cat([rows, forward(rows)[:, -1:].argmax(-1)], dim=1)
    return rows[:, prompt.shape[1] :]


def build_forwards(
    model: MambaLMHeadModel, example: Tensor, out_dir: Path, aoti: bool
) -> tuple[dict[str, tuple[Forward, float]], dict[str, Path]]:
    """The model's forward every way it ships: {mode: (forward, build seconds)}, and the paths
    of the files written. The artifacts are loaded back from disk, as a deployment would."""
    forwards: dict[str, tuple[Forward, float]] = {"eager": (model, 0.0)}
    paths = {"weights": out_dir / "copying_weights.pt"}
    torch.save(model.state_dict(), paths["weights"])

    start = time.perf_counter()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        compiled(example)  # compiles
    forwards["torch.compile"] = (compiled, time.perf_counter() - start)

    start = time.perf_counter()
    exported = export_forward(model, example)
    paths["torch.export"] = out_dir / "copying_exported.pt2"
    torch.export.save(exported, paths["torch.export"])
    loaded = torch.export.load(paths["torch.export"]).module()
    forwards["torch.export"] = (loaded, time.perf_counter() - start)

    if aoti:
        start = time.perf_counter()
        paths["AOTInductor"] = out_dir / "copying_aoti.pt2"
        torch._inductor.aoti_compile_and_package(exported, package_path=str(paths["AOTInductor"]))
        package = torch._inductor.aoti_load_package(str(paths["AOTInductor"]))
        forwards["AOTInductor"] = (package, time.perf_counter() - start)
    return forwards, paths


def add_onnx_forward(
    model: MambaLMHeadModel,
    example: Tensor,
    out_dir: Path,
    forwards: dict[str, tuple[Forward, float]],
    paths: dict[str, Path],
    out: TextIO,
) -> None:
    """Add the ONNX artifact to forwards and paths: the forward exported by selective_scan.onnx
    (dynamic batch and length as export_forward), saved, and loaded into an ONNX Runtime
    session on CPU. Where the onnx packages are missing, says so in one line and adds nothing."""
    try:
        import onnxruntime

        from .. import onnx as onnx_export
    except ImportError as error:
        package = (error.name or "onnx").split(".")[0]
        print(f"ONNX artifact skipped: {package} is not installed (pip install -e \".[onnx]\")",
              file=out)  # fmt: skip
        return
    start = time.perf_counter()
    paths["ONNX"] = out_dir / "copying.onnx"
    dims = {
        0: torch.export.Dim("batch", min=2),
        1: torch.export.Dim("seqlen", min=MIN_EXPORT_SEQLEN),
    }
    # Exported from a CPU copy: the file runs on CPU, and the PyTorch ops' path is the same
    # on every machine.
    cpu_model = model if example.device.type == "cpu" else copy.deepcopy(model).cpu()
    with torch.no_grad():
        onnx_export.export(cpu_model, (example.cpu(),), paths["ONNX"],
                           dynamic_shapes={"input_ids": dims})  # fmt: skip
    session = onnxruntime.InferenceSession(str(paths["ONNX"]), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def forward(input_ids: Tensor) -> Tensor:
        logits = session.run(None, {name: input_ids.cpu().numpy()})[0]
        return torch.from_numpy(logits).to(input_ids.device)

    forwards["ONNX Runtime"] = (forward, time.perf_counter() - start)


@torch.no_grad()
def compare_forwards(
    forwards: dict[str, tuple[Forward, float]],
    task: SelectiveCopying,
    rows: Tensor,
    tolerance: float,
    repeats: int,
) -> list[Row]:
    """Run each forward on rows without their last token (batch, seqlen - 1): time, max
    |logits - eager logits| and answer accuracy. The first forward is the eager one."""
    inputs = rows[:, :-1].contiguous()  # as the export example: strides are not dynamic
    expected = None
    table = []
    for mode, (forward, build_s) in forwards.items():
        logits = forward(inputs)
        expected = logits if expected is None else expected
        max_diff = (logits - expected).abs().max().item()
        accuracy = task.loss_and_accuracy(logits, rows)[1].item()
        ms = time_call(lambda f=forward: f(inputs), repeats, rows.device)
        tokens_per_s = inputs.numel() / (ms / 1e3)
        ok = max_diff <= tolerance
        table.append(Row(mode, build_s, ms, tokens_per_s, max_diff, accuracy, ok))
    return table


@torch.no_grad()
def decode_examples(
    model: MambaLMHeadModel,
    forwards: dict[str, tuple[Forward, float]],
    task: SelectiveCopying,
    rows: Tensor,
) -> dict[str, Tensor]:
    """Greedy answers (batch, num_data) to the prompts of rows: "generate" through the model's
    prefill and step, and every other forward but torch.compile's through greedy_answers."""
    prompt = task.prompt(rows).contiguous()
    answers = {"expected": task.answer(rows)}
    answers["generate"] = model.generate(prompt, task.num_data)[:, prompt.shape[1] :]
    for mode, (forward, _) in forwards.items():
        if mode not in ("eager", "torch.compile"):
            answers[mode] = greedy_answers(forward, prompt, task.num_data)
    return answers


@torch.no_grad()
def cuda_graph_decode(
    model: MambaLMHeadModel, batch: int, repeats: int
) -> tuple[float, float, float]:
    """One decode step (batch tokens) on CUDA: (eager ms, CUDA-graph replay ms, max |logits
    difference| between the two)."""
    device = model.lm_head.weight.device
    tokens = torch.full((batch, 1), MARKER, device=device)
    cache = model.allocate_inference_cache(batch)
    eager_ms = time_call(lambda: model.step(tokens, cache), repeats, device)
    # Warm up on a side stream (kernel compilation and allocations stay out of the capture).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model.step(tokens, cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # step leaves the cache it is given unchanged: every replay computes the same step.
        graph_logits, _ = model.step(tokens, cache)
    graph_ms = time_call(graph.replay, repeats, device)
    max_diff = (graph_logits - model.step(tokens, cache)[0]).abs().max().item()
    return eager_ms, graph_ms, max_diff


def format_table(table: Sequence[Row], tolerance: float) -> str:
    lines = [
        f"{'mode':<14} {'build s':>8} {'ms/call':>9} {'tokens/s':>10} {'max|dlogit|':>12} "
        f"{'accuracy':>9}  ok",
        "-" * 70,
    ]
    for r in table:
        build = f"{r.build_s:8.1f}" if r.build_s else f"{'-':>8}"
        diff = f"{r.max_diff:12.2e}" if r.mode != "eager" else f"{'-':>12}"
        lines.append(
            f"{r.mode:<14} {build} {r.ms:9.2f} {r.tokens_per_s:10.0f} {diff} "
            f"{r.accuracy:9.4f}  {'yes' if r.ok else 'NO'}"
        )
    lines.append(f"max|dlogit|: largest difference from the eager logits (bound {tolerance:g})")
    return "\n".join(lines)


def format_answers(answers: dict[str, Tensor]) -> str:
    width = max(len(mode) for mode in answers)
    header = "  ".join(f"{mode:<{width}}" for mode in answers) + "  agree  correct"
    lines = [header]
    for i in range(len(answers["expected"])):
        texts = [as_text(answer[i]) for answer in answers.values()]
        produced = texts[1:]
        agree = all(t == produced[0] for t in produced)
        correct = all(t == texts[0] for t in produced)
        cells = "  ".join(f"{t:<{width}}" for t in texts)
        lines.append(f"{cells}  {'yes' if agree else 'NO':<5}  {'yes' if correct else 'no'}")
    return "\n".join(lines)


def answers_agree(answers: dict[str, Tensor]) -> bool:
    """Whether every decoder produced generate's answers (the expected ones aside)."""
    return all(torch.equal(a, answers["generate"]) for m, a in answers.items() if m != "expected")


def describe(task: SelectiveCopying, settings: Settings, device: torch.device, params: int) -> str:
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    return (
        f"selective copying: {task.num_data} of {task.num_symbols} symbols among "
        f"{task.context_len} tokens, then a marker (rows of {task.seqlen} tokens)\n"
        f"MambaLMHeadModel: d_model {settings.d_model}, {settings.n_layer} layers, d_state "
        f"{settings.d_state}, vocab {task.vocab_size}, {params / 1e3:.1f}k parameters; "
        f"{settings.steps} steps of {settings.batch} rows, lr {settings.lr:g}; on {device}"
        f"{threads}; torch {torch.__version__}"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m selective_scan.apps.copying",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default=None,
        help="sizes to start from (default: gpu on cuda, else cpu); the flags below override",
    )  # fmt: skip
    sizes = {
        "--seqlen": ("context_len", int, "context tokens before the marker"),
        "--num-data": ("num_data", int, "data tokens to copy"),
        "--symbols": ("num_symbols", int, "distinct data tokens"),
        "--d-model": ("d_model", int, None),
        "--layers": ("n_layer", int, None),
        "--d-state": ("d_state", int, None),
        "--steps": ("steps", int, "training steps"),
        "--batch": ("batch", int, "rows per training step"),
        "--lr": ("lr", float, "peak learning rate (warm-up, peak, cosine decay)"),
    }
    for flag, (dest, kind, help_text) in sizes.items():
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)
    parser.add_argument("--eval-batch", type=int, default=256, help="held-out rows checked")
    parser.add_argument("--examples", type=int, default=4, help="held-out prompts decoded (>= 2)")
    parser.add_argument("--min-accuracy", type=float, default=0.95)
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max |logit difference|")
    parser.add_argument("--no-aoti", action="store_true", help="skip the AOTInductor package")
    parser.add_argument("--out", default="copying_out", help="where the files are written")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per forward")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None,
        help="CPU threads for torch (default: torch's choice). On a machine shared with other "
        "busy processes, 1 can be many times faster than threads that wait for each other",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.examples < 2 or args.eval_batch < 2:
        parser.error("--examples and --eval-batch must be at least 2 (the exported batch size)")
    if args.context_len is not None and args.context_len + 1 < MIN_EXPORT_SEQLEN:
        parser.error(f"--seqlen must be at least {MIN_EXPORT_SEQLEN - 1} (the exported length)")
    return args


def settings_from(args: argparse.Namespace, device: torch.device) -> Settings:
    """The preset's settings with every size given on the command line replacing its own."""
    preset = PRESETS[args.preset or ("gpu" if device.type == "cuda" else "cpu")]
    given = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(Settings)
        if getattr(args, field.name) is not None
    }
    return dataclasses.replace(preset, **given)


def find_failures(table: Sequence[Row], answers: dict[str, Tensor], min_accuracy: float):
    """What fails the run, as messages: eager held-out accuracy (table[0]) below min_accuracy, a
    forward off eager by more than its tolerance, a greedy answer other than generate's."""
    failures = []
    if table[0].accuracy < min_accuracy:
        failures.append(f"held-out accuracy {table[0].accuracy:.4f} < {min_accuracy}")
    failures += [f"{r.mode} differs from eager by {r.max_diff:.2e}" for r in table if not r.ok]
    if not answers_agree(answers):
        failures.append("greedy answers differ from generate's")
    return failures


def run(args: argparse.Namespace, out: TextIO) -> list[str]:
    """The whole job, reporting to out; returns the failed checks (none: success)."""
    start = time.perf_counter()
    device = device_from(args.device)
    settings = settings_from(args, device)
    task = SelectiveCopying(settings.context_len, settings.num_data, settings.num_symbols)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = build_model(settings, task.vocab_size, device, args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(describe(task, settings, device, params), file=out)
    print("training (the first step compiles the forward and backward)", file=out, flush=True)
    trained = train(model, task, settings, device, args.seed)
    print(
        f"trained in {trained.seconds:.1f} s (first step, compiling: {trained.first_step_s:.1f} "
        f"s), {trained.tokens_per_s:,.0f} tokens/s; last batch: loss {trained.loss:.4f}, "
        f"accuracy {trained.accuracy:.4f}",
        file=out,
        flush=True,
    )

    held_out = torch.Generator().manual_seed(args.seed + HELD_OUT_SEED_OFFSET)
    rows = task.sample(args.eval_batch, held_out).to(device)
    example_rows = task.sample(args.examples, held_out).to(device)
    example = rows[:, :-1].contiguous()  # export traces strides too: a slice's would stay
    forwards, paths = build_forwards(model, example, out_dir, aoti=not args.no_aoti)
    add_onnx_forward(model, example, out_dir, forwards, paths, out)
    table = compare_forwards(forwards, task, rows, args.tolerance, args.repeats)
    answers = decode_examples(model, forwards, task, example_rows)
    with torch.no_grad():
        generated = model.generate(task.prompt(rows), task.num_data)[:, task.context_len + 1 :]
    whole_answers = (generated == task.answer(rows)).all(dim=1).float().mean().item()

    print(f"\nforward on {args.eval_batch} held-out rows of {task.seqlen - 1} tokens", file=out)
    print(format_table(table, args.tolerance), file=out)
    print(f"\ngreedy answers to {args.examples} held-out prompts", file=out)
    print(format_answers(answers), file=out)
    if device.type == "cuda":
        eager_ms, graph_ms, graph_diff = cuda_graph_decode(model, args.eval_batch, args.repeats)
        print(
            f"\ndecode step of {args.eval_batch} rows: eager {eager_ms:.3f} ms, CUDA graph "
            f"{graph_ms:.3f} ms ({args.eval_batch / graph_ms * 1e3:,.0f} tokens/s), "
            f"max|dlogit| {graph_diff:.1e}",
            file=out,
        )

    speeds = ", ".join(f"{r.mode} {r.tokens_per_s:,.0f}" for r in table)
    print("\nsummary", file=out)
    print(
        f"  held-out accuracy {table[0].accuracy:.4f} (answer tokens, {args.eval_batch} rows); "
        f"whole answers right by greedy generate: {whole_answers:.4f}",
        file=out,
    )
    print(f"  training {trained.seconds:.1f} s; forward tokens/s: {speeds}", file=out)
    for name, path in paths.items():
        print(f"  {name + ' file:':<18} {path.resolve()}", file=out)
    print(f"  total {time.perf_counter() - start:.1f} s", file=out)
    return find_failures(table, answers, args.min_accuracy)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 when every check passes)."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Noise from torch's internals, not about this package (as in the demo).
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # Torch 2.13's CPU build may compute the first float32 exp of a process inexactly on the
    # second thread (see the project's notes); a tiny single-threaded exp first avoids it.
    torch.exp(torch.zeros(1))
    # Compile caches are keyed without the ops' fake implementations: build from scratch.
    with torch._inductor.config.patch(force_disable_caches=True):
        return exit_status(run(args, sys.stdout))


def exit_status(failures: list[str]) -> int:
    """Report the failed checks on stderr (1), or that all passed (0)."""
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if failures:
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
