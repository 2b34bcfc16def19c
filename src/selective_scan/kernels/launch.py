"""Eager launches of compiled Triton kernels without Triton's per-call argument binding.

``kernel[grid](*args)`` binds every argument, computes the specialization key and looks the
compiled kernel up on each call: 29 us of host time for the decode step's 40 arguments on the
H200's host (bench/results/decode.json), several times what the step takes on the GPU. Our
launch plans are cached per input layout and fix the grid, every non-tensor argument and the
options, so the compiled kernel differs between calls of one plan only by what Triton
specializes on the tensors themselves: the 16-byte alignment of their data pointers (dtypes
are part of the layout). ``Launcher`` keeps the compiled kernel by that alignment and the
device, and launches it directly.

This reads Triton 3.x internals (``JITFunction.device_caches``, ``CompiledKernel.run``). It
falls back to Triton's own launch under the interpreter, for tensors not on a CUDA device, while
a launch hook is set (profilers such as proton read launch metadata), and for good if those
internals are missing.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import os
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor
from torch.library import wrap_triton
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

try:
    from triton import knobs
    from triton.runtime import driver
except ImportError:  # an older Triton: no direct launches
    knobs = driver = None

PLAIN_TYPES = (Tensor, torch.nn.Parameter)


def intercepted() -> bool:
    """Whether something traces or intercepts calls now: torch.compile or export, a dispatch
    or function mode (FakeTensorMode, tracing, profiling modes...), a functorch transform.
    Calling an implementation directly instead of its op is only right when nothing does."""
    return (
        torch.compiler.is_compiling()
        or is_in_torch_dispatch_mode()
        or torch._C._is_torch_function_mode_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
    )


def direct_call_ok(tensors) -> bool:
    """Whether calling an operator's implementation directly is indistinguishable from calling
    the operator: nothing traces or intercepts the call (``intercepted``), every tensor is a
    plain one (or None), and autograd would record nothing. The public functions then skip the
    dispatcher, whose cost matters on short eager calls (a decode step, a small scan)."""
    if intercepted():
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:  # a loop, not all(generator): this runs for every decoded token
        if t is not None and (type(t) not in PLAIN_TYPES or (grad and t.requires_grad)):
            return False
    return True


def is_plain_eager(tensors) -> bool:
    """Whether launching now is indistinguishable from what tracing would record: nothing
    intercepts calls and every tensor is a plain one. (Inside a triton_op's eager call this
    holds; the launchers are also called outside the op, by benchmarks and tools.) It is also
    when a forward op's implementation may run in an autograd.Function of its own instead of
    the op (ops._eager_function), which records the node the op's registered autograd would."""
    if intercepted():
        return False
    return all(t is None or is_plain(t) for t in tensors)


def is_plain(t) -> bool:
    """Whether t is a plain tensor: of type Tensor or Parameter (FakeTensor is not), and no
    functional or functorch wrapper (of type Tensor too), behind which a fake tensor may hide.
    Two flag reads, where is_fake walks more cases: this runs for every input of every eager
    call."""
    return type(t) in PLAIN_TYPES and not (
        torch._is_functional_tensor(t) or torch._C._functorch.is_functorch_wrapped_tensor(t)
    )


def runtime_params(kernel) -> tuple[str, ...]:
    """The names of a JIT kernel's parameters that are not constexprs, in order (for a JIT
    function and for the interpreter's wrapper alike)."""
    import triton.language as tl  # this module loads where triton is missing too

    params = inspect.signature(kernel.fn).parameters.values()
    return tuple(p.name for p in params if p.annotation not in (tl.constexpr, "tl.constexpr"))


# Keywords of a Triton launch that are not kernel parameters.
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl"})


def kernel_arguments(kernel, arguments: Mapping) -> dict:
    """The arguments ``kernel`` takes: its parameters and the launch options. A plan builds one
    set of arguments for kernels that take different subsets of it (the lanes kernel takes no
    range, packed-sequence or PRE arguments), so each kernel declares only what it uses."""
    params = set(kernel.arg_names)
    return {k: v for k, v in arguments.items() if k in params or k in LAUNCH_OPTIONS}


class Launcher:
    """Launches of one kernel with one plan: ``launcher(tensors)`` runs
    ``kernel[grid](**kernel_arguments(kernel, tensors | scalars | options))``, where the plan
    fixes grid, scalars and options (the caller keeps one Launcher per plan and per value of any
    option it varies). Every argument is passed by name; the kernel's tensor parameters must
    come first in its signature, in any order among themselves."""

    __slots__ = ("_compiled", "_order", "grid", "kernel", "options", "scalars")

    def __init__(self, kernel, grid: tuple, scalars: Mapping, options: dict):
        self.kernel, self.grid = kernel, grid
        self.scalars = kernel_arguments(kernel, scalars)
        self.options = kernel_arguments(kernel, options)
        # (device, alignment of each tensor) -> (CompiledKernel.run, function, metadata, tail)
        self._compiled: dict[tuple, tuple] | None = {} if _direct_launches_work() else None
        self._order: tuple[str, ...] | None = None  # the tensor parameters in signature order

    def __call__(self, tensors: dict) -> None:
        compiled = self._compiled
        first = next(iter(tensors.values()))
        if compiled is None or not first.is_cuda or _hooks_set():
            self.kernel[self.grid](**self._arguments(tensors))
            return
        order = self._order or self._tensor_order(tensors)
        device = _current_device()
        # Pointers as ints: Triton's launcher then skips a data_ptr() call and a CUDA driver
        # query per tensor (the plan's checks already put every tensor on this CUDA device).
        ptrs = [None if (t := tensors[name]) is None else t.data_ptr() for name in order]
        key = (device, *[p is None or p % 16 == 0 for p in ptrs])
        entry = compiled.get(key)
        if entry is None:  # this launch goes through Triton, which compiles or finds the kernel
            entry = self._launch_and_keep(device, tensors)
            if entry is not None:
                compiled[key] = entry
            return
        launch, function, head, tail = entry
        launch(*self.grid, _current_stream(device), function, *head, *ptrs, *tail)

    def _arguments(self, tensors: dict) -> dict:
        return kernel_arguments(self.kernel, tensors) | self.scalars | self.options

    def _tensor_order(self, tensors: dict) -> tuple[str, ...]:
        """The tensors the kernel takes, in its order: they must be its leading parameters, as a
        direct launch passes pointers by position."""
        names = self.kernel.arg_names
        order = tuple(name for name in names if name in tensors)
        if order != tuple(names[: len(order)]):
            raise TypeError(
                f"{self.kernel.__name__}: tensor arguments {list(order)} are not the kernel's "
                f"leading parameters {list(names[: len(order)])}"
            )
        self._order = order
        return order

    def _launch_and_keep(self, device: int, tensors: dict) -> tuple | None:
        """Launch through Triton (compiling if needed) and return what a direct launch of the
        same kernel needs: (launch function, CUfunction, the arguments between the function and
        the kernel's own, the kernel's arguments after its tensors); None when Triton did not
        return a compiled kernel."""
        kwargs = self._arguments(tensors)
        kernel = self.kernel[self.grid](**kwargs)
        if kernel is None or not hasattr(kernel, "packed_metadata"):
            return None
        bound = tuple(self.kernel.device_caches[device][4](**kwargs)[0].values())
        tail = bound[len(self._order) :]
        run = kernel.run  # loads the module on this device, which sets .function
        # No launch metadata, no hooks: (packed metadata, launch metadata, enter, exit hooks).
        head = (kernel.packed_metadata, None, None, None)
        if all(getattr(run, name, 1) == 0 for name in _SCRATCH_SIZES):
            # Triton's launcher object (CudaLauncher.__call__) only allocates scratch the kernel
            # asks for, then calls its compiled module's launch with the launch attributes:
            # with none to allocate, that call is made here (a Python frame less a launch).
            head = (run.launch_cooperative_grid, run.launch_pdl, None, None, *head)
            run = run.launch
        return run, kernel.function, head, tail


# A compiled kernel's launcher attributes: the scratch sizes it allocates per launch.
_SCRATCH_SIZES = ("global_scratch_size", "profile_scratch_size")


# Launches recorded (``recording``): (list or None, whether to launch them too) while a block
# records or skips them, else None.
_RECORD: contextvars.ContextVar[tuple[list | None, bool] | None] = contextvars.ContextVar(
    "selective_scan_recorded_launches", default=None
)


@contextlib.contextmanager
def _recording_into(launches: list | None, launch: bool) -> Iterator[None]:
    token = _RECORD.set((launches, launch))
    try:
        yield
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def recording(launch: bool = False) -> Iterator[list]:
    """Inside the block, ``launch_kernel`` records (kernel, grid, kwargs, key) in the list it
    yields, and launches nothing unless ``launch``: for offline compiles, and for inspecting
    what a call launches and with which launcher key."""
    launches: list = []
    with _recording_into(launches, launch):
        yield launches


def skipping_launches() -> contextlib.AbstractContextManager:
    """Inside the block, ``launch_kernel`` returns at once: it launches nothing and keeps
    nothing (no reference to any tensor). For timing the launchers' host work but the launches
    where the kernels cannot run (bench/host_profile.py --device cpu). Records would keep the
    gradients referenced, and autograd then copies each into .grad instead of taking it."""
    return _recording_into(None, False)


def launch_kernel(launchers: dict | None, kernel, grid: tuple, tensors: dict, scalars: Mapping,
                  options: dict, key) -> None:  # fmt: skip
    """kernel[grid](**tensors, **scalars, **options), of which the kernel takes what it declares
    (``kernel_arguments``): directly with ``launchers`` (a plan's Launchers, by ``key``, for
    plain eager calls on CUDA tensors), through wrap_triton when it is None (traced calls, the
    interpreter)."""
    record = _RECORD.get()
    if record is not None and record[0] is None:  # skipping_launches
        return
    if record is not None or launchers is None:
        kwargs = kernel_arguments(kernel, {**tensors, **scalars, **options})
    if record is not None:
        record[0].append((kernel, grid, kwargs, key))
        if not record[1]:
            return
    if launchers is None:
        wrap_triton(kernel)[grid](**kwargs)
        return
    launcher = launchers.get(key)
    if launcher is None:
        launcher = Launcher(kernel, grid, scalars, options)
        launchers[key] = launcher
    sequence = _SEQUENCE.get()
    if sequence is not None:
        sequence.append((launcher, tensors))
    launcher(tensors)


# (launcher, tensors) of each direct launch while ``launch_sequence`` records a call's.
_SEQUENCE: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "selective_scan_launch_sequence", default=None
)


def launch_sequence(sequences: dict | None, key, tensors: dict, launch: Callable[[], None]):
    """Run ``launch()``, a call's launches and nothing else, each through ``launch_kernel``
    and reading its tensors from the one dict ``tensors`` by parameter name. Or, where
    ``sequences`` holds the launchers an earlier call ran with this ``key``, call those
    launchers on ``tensors``: the same launches without the Python that picks each one's
    arguments and launcher, host time that short calls wait on (design §11).

    ``sequences``: a plan's, None where launches are not direct (traced calls). ``key``: what
    the launches depend on that the plan leaves open. A call's sequence is kept only when all
    its launches went directly, each on ``tensors``; nothing is replayed or kept while
    launches are recorded or skipped (``recording``, ``skipping_launches``)."""
    if sequences is None or _RECORD.get() is not None:
        launch()
        return
    recorded = sequences.get(key)
    if recorded is not None:
        for launcher in recorded:
            launcher(tensors)
        return
    token = _SEQUENCE.set([])
    try:
        launch()
        ran = _SEQUENCE.get()
    finally:
        _SEQUENCE.reset(token)
    if all(seen is tensors for _, seen in ran):
        sequences[key] = [launcher for launcher, _ in ran]


def _hooks_set() -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps them in HookChains (never None; empty
    when nothing is registered), older versions as plain callables or None."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(getattr(enter, "calls", enter) or getattr(exit_, "calls", exit_))


def on_device_of(t) -> contextlib.AbstractContextManager:
    """``torch.cuda.device`` of a real CUDA tensor t where it is not the current device, else
    nothing. Triton launches on the current device, and so does a direct launch; a model spread
    over GPUs in one process (a layer on cuda:1 while cuda:0 is current) would otherwise run its
    kernels on the wrong GPU, as mamba_ssm's CUDA extension does not (a device guard a call).
    Traced calls (fake tensors) get nothing: the compiled code sets its own devices."""
    if type(t) in PLAIN_TYPES and t.is_cuda:
        index = t.get_device()
        if index != _current_device():
            return torch.cuda.device(index)
    return contextlib.nullcontext()


def _current_device() -> int:
    """The current CUDA device, as Triton's launch asks it (torch.cuda.current_device without
    its lazy initialization check: a direct launch follows a CUDA tensor's allocation)."""
    return torch._C._cuda_getDevice()


def _current_stream(device: int) -> int:
    """The raw current stream of a CUDA device (Triton's driver reads the same)."""
    return torch._C._cuda_getCurrentRawStream(device)


def _direct_launches_work() -> bool:
    return (
        driver is not None
        and os.environ.get("TRITON_INTERPRET") != "1"
        and hasattr(knobs, "runtime")
        and hasattr(knobs.runtime, "launch_enter_hook")
        and hasattr(torch._C, "_cuda_getCurrentRawStream")
    )
