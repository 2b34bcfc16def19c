"""Training-step benchmark: what a user pays per step of the Mamba layer and of whole models.

    python bench/train_bench.py --out $OUT                          (CUDA, all cases, H200)
    python bench/train_bench.py --out /tmp/x --device cpu --small   (CPU smoke run, eager)
    python bench/train_bench.py --out $OUT --cases model,hf --budget-s 120

A step is forward, loss, backward, ``AdamW.step()`` and ``zero_grad(set_to_none=True)`` on one
fixed random batch, the optimizer as a user builds it (``torch.optim.AdamW`` with its defaults:
the foreach implementation on CUDA). Cases (``--cases`` picks the groups):

* layer: our ``Mamba`` layer (fast path: one ``mamba_inner_fn`` call), d_model 1024 and 2560,
  batch 8 x seqlen 2048 (16k tokens), weights and activations bf16 (A_log and D stay fp32, as
  the layer keeps them); loss ``out.float().pow(2).mean()``. The input requires grad, as inside
  a model, so the backward includes in_proj's input gradient.
* model: ``MambaLMHeadModel`` of mamba-130m's shape (d_model 768, 24 layers, vocab 50277
  padded to 50280), 8 x 2048 random token ids, next-token cross-entropy. Mixed precision as
  mamba_ssm recommends: fp32 master weights and optimizer state, forward under
  ``torch.autocast(bfloat16)``; the loss takes the full logits (in fp32) with targets shifted
  (the last position ignored), as transformers' loss does, so no shifted copy of the logits.
* hf: transformers' ``MambaForCausalLM`` of the same shape (MambaConfig: hidden 768, 24
  layers, vocab 50280, state 16, expand 2, conv 4), the same precision, loss from ``labels``,
  eager only. fast: with ``selective_scan.hf.patch_transformers()`` (the mixer's training
  branch calls the patched ``mamba_inner_fn``), at 8 x 2048 and at 2 x 512; slow: stock
  transformers, whose own ``mamba_inner_fn`` returns None without mamba_ssm, so the mixer runs
  its PyTorch path (in eager mode a Python loop over the sequence), at 2 x 512 only (the
  like-for-like pair is fast vs slow at 2 x 512). A counter on the module's
  ``mamba_inner_fn`` during the first step records which path ran (fused calls per step).

Every eager case runs first, then ``torch.compile`` of the model's and the layers' forward +
loss as one function (``fullgraph=True``; ``fullgraph=False`` if that fails, with the error
recorded), the model first (if the budget runs out, a layer's compile is what goes); the
backward runs through the compiled graph, the optimizer stays eager. On CPU the compiled cases
are left out unless ``--cpu-compile`` (the three tiny compiles take minutes on 2 cores).

Timing: the first step (Triton JIT, and for compiled cases the compile) is timed on its own
as ``first_step_s``; then warm-up steps, then 10-15 timed steps (fewer when a step is slow:
about 15 s of timed steps per case, 3 at least), each between two CUDA events, median;
``wall_ms_per_step`` is the host clock over all timed steps (the two differ when the host
cannot keep ahead of the GPU). Peak memory: ``torch.cuda.max_memory_allocated`` over the
timed steps after a reset (weights, optimizer state, activations); ``resident_bytes``: memory
allocated between steps (weights and optimizer state). On CPU: host clock per step, no memory.

Writes <out>/train.json after every case (a run cut short keeps what it measured); a failing
case records its error and the rest still run; cases left when ``--budget-s`` seconds have
passed are recorded as skipped. ``--small``: tiny shapes (d_model 32/64, 2 layers, seqlen 64)
and few steps, a smoke test of the script (on CPU in one thread).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from report import environment, git_commit, guarded

from selective_scan import Mamba, MambaLMHeadModel

TIMED_S = 15.0  # timed steps per case stop at about this many seconds (3 steps at least)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    """Drop the previous case's model and optimizer before the next case measures its peak."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- timing ----------------------------------------------------------------------------------


def first_step(step: Callable[[], object], device: str) -> float:
    """Seconds of one synchronized step (the first: JIT compiles, torch.compile's compile)."""
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def time_steps(
    step: Callable[[], object],
    device: str,
    warmup: int,
    steps: int,
    first_s: float | None = None,
) -> dict:
    """Median ms per step of step() after its first call and warm-up, with peak memory.

    The last warm-up step is timed alone to pick how many steps to time (steps, fewer if they
    would take more than TIMED_S seconds, 3 at least)."""
    if first_s is None:
        first_s = first_step(step, device)
    for _ in range(max(0, warmup - 2)):
        step()
    estimate_s = first_step(step, device) if warmup >= 2 else first_s
    count = max(3, min(steps, int(TIMED_S / max(estimate_s, 1e-6))))
    result = {"first_step_s": first_s, "warmup_steps": max(1, warmup), "timed_steps": count}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        result["resident_bytes"] = torch.cuda.memory_allocated()
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(count)
        ]
    times_ms = []
    sync(device)
    wall0 = time.perf_counter()
    for i in range(count):
        if cuda:
            events[i][0].record()
            step()
            events[i][1].record()
        else:
            t0 = time.perf_counter()
            step()
            times_ms.append(1e3 * (time.perf_counter() - t0))
    sync(device)
    wall_s = time.perf_counter() - wall0
    if cuda:
        times_ms = [start.elapsed_time(end) for start, end in events]
        result["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    result.update(
        ms_per_step=statistics.median(times_ms),
        ms_min=min(times_ms),
        ms_max=max(times_ms),
        wall_ms_per_step=1e3 * wall_s / count,
    )
    return result


def train_step(
    loss_fn: Callable, inputs: tuple, optimizer: torch.optim.Optimizer, losses: dict
) -> Callable[[], None]:
    """One training step of loss_fn(*inputs); keeps the loss tensors of the first and the latest
    step in losses (read once at the end: no synchronization inside the timed loop)."""
    leaves = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]

    def step() -> None:
        loss = loss_fn(*inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for t in leaves:  # an input that requires grad stands for the previous layer's output
            t.grad = None
        losses.setdefault("loss_first", loss.detach())
        losses["loss_last"] = loss.detach()

    return step


def run_case(
    loss_fn: Callable,
    inputs: tuple,
    module: torch.nn.Module,
    args,
    *,
    config: dict,
    compile_fn: bool,
    warmup: int,
    steps: int,
    first_step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> dict:
    """Build AdamW over module's parameters, then time training steps of loss_fn (compiled
    with torch.compile when compile_fn: fullgraph first, then fullgraph=False); the first step
    runs inside the context manager that first_step_context() makes, when given. The result
    holds config (with batch and seqlen) plus the module's parameter count, and the tokens a
    step trains on."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    result = {
        "config": config | {"params": sum(p.numel() for p in module.parameters())},
        "tokens_per_step": config["batch"] * config["seqlen"],
        "optimizer": "torch.optim.AdamW(lr=1e-4), defaults otherwise",
    }
    losses: dict = {}
    if compile_fn:
        torch._dynamo.reset()  # a previous case's graphs would make this one's shapes dynamic
        before = dynamo_counts()
    for fullgraph in (True, False) if compile_fn else (None,):
        fn = loss_fn if fullgraph is None else torch.compile(loss_fn, fullgraph=fullgraph)
        step = train_step(fn, inputs, optimizer, losses)
        try:
            with (first_step_context or contextlib.nullcontext)():
                first_s = first_step(step, args.device)
        except Exception as e:
            if fullgraph is not True:
                raise
            result["fullgraph_error"] = repr(e)[:2000]
            optimizer.zero_grad(set_to_none=True)
            torch._dynamo.reset()
            continue
        break
    if compile_fn:
        result["fullgraph"] = fullgraph
        result |= {k: v - before.get(k, 0) for k, v in dynamo_counts().items()}
    result |= time_steps(step, args.device, warmup, steps, first_s=first_s)
    if compile_fn:  # the first step's time beyond a steady step's
        result["compile_s"] = result["first_step_s"] - result["ms_per_step"] / 1e3
    result |= {key: loss.item() for key, loss in losses.items()}
    return result


def dynamo_counts() -> dict:
    """Graphs dynamo has made and graph breaks it has taken in this process, from its
    counters (cumulative: torch._dynamo.reset() keeps them)."""
    with contextlib.suppress(Exception):
        from torch._dynamo.utils import counters

        return {
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values()),
        }
    return {}


def autocast(device: str):
    return torch.autocast(device, dtype=torch.bfloat16)


# ---- the cases -------------------------------------------------------------------------------


def shapes(args) -> dict:
    """Sizes of every case, real or --small."""
    if args.small:
        return {
            "layer_d_models": (32, 64),
            "layer_tokens": (2, 64),
            "model": (64, 2, 256),
            "model_tokens": (2, 64),
            "hf_small_tokens": (1, 32),
            "warmup": 2,
            "steps": 3,
        }
    return {
        "layer_d_models": (1024, 2560),
        "layer_tokens": (8, 2048),
        "model": (768, 24, 50277),
        "model_tokens": (8, 2048),
        "hf_small_tokens": (2, 512),
        "warmup": 3,
        "steps": 15,
    }


def case_layer(args, d_model: int, compile_fn: bool) -> dict:
    batch, seqlen = shapes(args)["layer_tokens"]
    torch.manual_seed(0)
    layer = Mamba(d_model, device=args.device, dtype=torch.bfloat16)
    x = torch.randn(batch, seqlen, d_model, device=args.device, dtype=torch.bfloat16)
    x.requires_grad_(True)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        return layer(x).float().pow(2).mean()

    sizes = shapes(args)
    config = {
        "d_model": d_model,
        "d_inner": layer.d_inner,
        "d_state": layer.d_state,
        "batch": batch,
        "seqlen": seqlen,
        "dtype": "bf16 weights and activations",
    }
    return run_case(
        loss_fn,
        (x,),
        layer,
        args,
        config=config,
        compile_fn=compile_fn,
        warmup=sizes["warmup"],
        steps=sizes["steps"],
    )


def random_tokens(batch: int, seqlen: int, vocab: int, device: str) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(1)
    return torch.randint(vocab, (batch, seqlen), generator=gen, device=device)


def case_model(args, compile_fn: bool) -> dict:
    sizes = shapes(args)
    d_model, n_layer, vocab = sizes["model"]
    batch, seqlen = sizes["model_tokens"]
    torch.manual_seed(0)
    model = MambaLMHeadModel(
        d_model, n_layer, vocab, pad_vocab_size_multiple=8, device=args.device
    ).train()
    ids = random_tokens(batch, seqlen, vocab, args.device)
    # Next-token targets over the full logits, the last position ignored (no shifted copy).
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)
    device = args.device

    def loss_fn(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(device):
            logits = model(ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    config = {
        "d_model": d_model,
        "n_layer": n_layer,
        "vocab": vocab,
        "padded_vocab": model.lm_head.weight.shape[0],
        "batch": batch,
        "seqlen": seqlen,
        "precision": "fp32 weights, autocast bf16",
    }
    return run_case(
        loss_fn,
        (ids, targets),
        model,
        args,
        config=config,
        compile_fn=compile_fn,
        warmup=sizes["warmup"],
        steps=min(sizes["steps"], 10),
    )


@contextlib.contextmanager
def counting_inner(calls: dict):
    """Counts the calls of transformers' module-level ``mamba_inner_fn`` (whatever it is now)
    and those that returned a tensor (the fused path ran; None sends the mixer to PyTorch)."""
    from transformers.models.mamba import modeling_mamba

    inner = modeling_mamba.mamba_inner_fn

    def counted(*args, **kwargs):
        out = inner(*args, **kwargs)
        calls["calls"] += 1
        calls["fused"] += out is not None
        return out

    modeling_mamba.mamba_inner_fn = counted
    try:
        yield
    finally:
        modeling_mamba.mamba_inner_fn = inner


def case_hf(args, fast: bool, tokens: tuple[int, int]) -> dict:
    import transformers
    from transformers import MambaConfig, MambaForCausalLM

    from selective_scan import hf

    sizes = shapes(args)
    d_model, n_layer, vocab = sizes["model"]
    vocab = -(-vocab // 8) * 8  # mamba-130m-hf's vocab_size: 50277 padded to 50280
    batch, seqlen = tokens
    config = dict(
        vocab_size=vocab,
        hidden_size=d_model,
        num_hidden_layers=n_layer,
        state_size=16,
        expand=2,
        conv_kernel=4,
    )
    hf.unpatch_transformers()  # stock transformers unless this case patches
    try:
        if fast:
            hf.patch_transformers()
        torch.manual_seed(0)
        model = MambaForCausalLM(MambaConfig(**config)).to(args.device).train()
        ids = random_tokens(batch, seqlen, vocab, args.device)
        device = args.device

        def loss_fn(ids: torch.Tensor) -> torch.Tensor:
            with autocast(device):
                return model(input_ids=ids, labels=ids, use_cache=False).loss

        calls = {"calls": 0, "fused": 0}
        result = {
            "transformers": transformers.__version__,
            "path": "fast: patch_transformers()" if fast else "slow: stock transformers",
        }
        # The slow path's step takes seconds on the H200: no warm-up beyond the first step, 3
        # timed steps. The first step counts the fused calls, to record which path ran.
        warmup, steps = (sizes["warmup"], 10) if fast else (1, 3)
        result |= run_case(
            loss_fn,
            (ids,),
            model,
            args,
            config=config
            | {"batch": batch, "seqlen": seqlen, "precision": "fp32 weights, autocast bf16"},
            compile_fn=False,
            warmup=warmup,
            steps=steps,
            first_step_context=lambda: counting_inner(calls),
        )
        if not fast:
            result["slow_scan"] = (
                "transformers' sequential loop (use_mambapy off; its associative scan is "
                "taken only under torch.compile)"
            )
        result["fused_mamba_inner_calls_per_step"] = calls["fused"]
        result["mamba_inner_calls_per_step"] = calls["calls"]
        if calls["fused"] != (n_layer if fast else 0):
            result["warning"] = f"expected {n_layer if fast else 0} fused calls, saw {calls}"
        return result
    finally:
        hf.unpatch_transformers()


def cases(args) -> dict[str, tuple[str, Callable[[], dict]]]:
    """{case name: (group, thunk)} in run order: every eager case first (the comparisons the
    budget must keep), then the compiled ones (each pays a compile)."""
    sizes = shapes(args)
    d1, d2 = sizes["layer_d_models"]
    big, small = sizes["model_tokens"], sizes["hf_small_tokens"]
    tag = "tiny" if args.small else "130m"

    def name(tokens):
        return f"{tokens[0]}x{tokens[1]}"

    compile_ok = args.device == "cuda" or args.cpu_compile
    table = {
        f"layer_d{d1}_eager": ("layer", lambda: case_layer(args, d1, False)),
        f"layer_d{d2}_eager": ("layer", lambda: case_layer(args, d2, False)),
        f"model_{tag}_eager": ("model", lambda: case_model(args, False)),
        f"hf_{tag}_fast_{name(big)}": ("hf", lambda: case_hf(args, True, big)),
        f"hf_{tag}_fast_{name(small)}": ("hf", lambda: case_hf(args, True, small)),
        f"hf_{tag}_slow_{name(small)}": ("hf", lambda: case_hf(args, False, small)),
    }
    if compile_ok:  # the model first: if the budget runs out, a layer's compile goes
        table |= {
            f"model_{tag}_compiled": ("model", lambda: case_model(args, True)),
            f"layer_d{d2}_compiled": ("layer", lambda: case_layer(args, d2, True)),
            f"layer_d{d1}_compiled": ("layer", lambda: case_layer(args, d1, True)),
        }
    return table


# ---- driver ----------------------------------------------------------------------------------


def _num(value, spec: str) -> str:
    return format(value, spec) if isinstance(value, int | float) else "-"


def print_table(results: dict) -> None:
    print(f"\n{results['device']}, torch {results['torch']}, commit {results['commit'][:12]}")
    print(
        f"{'case':<28} {'tokens':>6} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>8} "
        f"{'1st s':>6}  note"
    )
    for case, r in results["cases"].items():
        if "error" in r or "skipped" in r:
            print(f"{case:<28} {r.get('error', r.get('skipped'))[:110]}")
            continue
        ms = r["ms_per_step"]
        peak = r.get("peak_memory_bytes")
        note = []
        if "fullgraph" in r:
            note.append(
                f"fullgraph={r['fullgraph']}, graphs {r.get('graphs', '-')}, "
                f"breaks {r.get('graph_breaks', '-')}"
            )
        if "fused_mamba_inner_calls_per_step" in r:
            note.append(f"fused calls {r['fused_mamba_inner_calls_per_step']}")
        if "warning" in r:
            note.append(r["warning"])
        print(
            f"{case:<28} {r['tokens_per_step']:>6} {ms:>9.2f} "
            f"{r['tokens_per_step'] / ms * 1e3:>10.0f} {_num(peak and peak / 2**30, '8.2f'):>8} "
            f"{r['first_step_s']:>6.1f}  {'; '.join(note)}"
        )
    for line in results.get("comparisons", []):
        print(line)
    if "note" in results:
        print(results["note"])


def comparisons(results: dict) -> list[str]:
    """Ratios of tokens/s between rows that differ in one thing: compiled vs eager, our model
    vs transformers' patched, transformers' fast vs slow path."""
    done = {k: r for k, r in results["cases"].items() if "ms_per_step" in r}

    def rate(key: str) -> float:
        return done[key]["tokens_per_step"] / done[key]["ms_per_step"]

    pairs = []
    for key in done:
        if key.endswith("_compiled") and key.replace("_compiled", "_eager") in done:
            pairs.append((key, key.replace("_compiled", "_eager")))
        if "_slow_" in key and key.replace("_slow_", "_fast_") in done:
            pairs.append((key.replace("_slow_", "_fast_"), key))
    model = next((k for k in done if k.startswith("model_") and k.endswith("_eager")), None)
    hf_big = next((k for k in done if k.startswith("hf_") and "_fast_" in k), None)
    if model and hf_big and done[model]["tokens_per_step"] == done[hf_big]["tokens_per_step"]:
        pairs.append((model, hf_big))
    return [f"tokens/s {a} / {b}: {rate(a) / rate(b):.2f}x" for a, b in pairs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="tiny shapes, few steps (smoke)")
    parser.add_argument("--cases", default="layer,model,hf", help="groups: layer,model,hf")
    parser.add_argument(
        "--budget-s", type=float, default=280.0, help="skip the cases left after this many seconds"
    )
    parser.add_argument(
        "--cpu-compile",
        action="store_true",
        help="on CPU, run the compiled cases too (left out by default: minutes on 2 cores)",
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers: the GPU has no network
    groups = set(args.cases.split(","))
    if unknown := groups - {"layer", "model", "hf"}:
        parser.error(f"unknown case groups {sorted(unknown)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = environment(args.device)
    with contextlib.suppress(ImportError):
        import transformers

        results["transformers"] = transformers.__version__
    results |= {
        "commit": git_commit(),
        "args": vars(args),
        "method": __doc__.split("\n\n", 2)[2].strip(),  # after the title and the usage
        "cases": {},
    }
    if args.device == "cpu" and args.small:
        # Tiny ops on a busy host: waking a thread pool per op costs ~100x the op itself.
        torch.set_num_threads(1)
        results["cpu_threads"] = 1
    if args.device == "cpu" and not args.cpu_compile:
        results["note"] = (
            "compiled cases left out on CPU (their compiles take minutes; --cpu-compile runs them)"
        )
        print(results["note"])
    start = time.perf_counter()
    for case, (group, thunk) in cases(args).items():
        if group not in groups:
            continue
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            results["cases"][case] = {
                "skipped": f"budget: {elapsed:.0f} s had passed, --budget-s {args.budget_s:g}"
            }
        else:
            t0 = time.perf_counter()
            r = results["cases"][case] = guarded(thunk)
            r["case_seconds"] = time.perf_counter() - t0
            if "ms_per_step" in r:
                r["tokens_per_s"] = r["tokens_per_step"] / r["ms_per_step"] * 1e3
            free_memory(args.device)
        results["total_seconds"] = time.perf_counter() - start
        results["comparisons"] = comparisons(results)
        print(case, json.dumps(results["cases"][case], default=str)[:300], flush=True)
        (out_dir / "train.json").write_text(json.dumps(results, indent=1, default=str))
    print_table(results)


if __name__ == "__main__":
    main()
