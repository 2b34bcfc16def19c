"""Run Hugging Face transformers' Mamba models on selective_scan's operators.

transformers' Mamba modeling module (transformers/models/mamba/modeling_mamba.py) looks up its
kernels as module globals at call time, and its mixer (``MambaMixer.forward``) calls:

* ``mamba_inner_fn`` in training without a cache (the fused layer; transformers' own returns
  None, which sends the mixer down the unfused path);
* ``causal_conv1d_fn`` and ``mamba_selective_scan`` for a prompt, ``causal_conv1d_update`` and
  ``mamba_selective_state_update`` for each cached decoding step.

These names are those of transformers 5 (tested on 5.24.0). transformers 4 (checked by hand on
4.57.6, by calling ``MambaMixer.cuda_kernels_forward`` on CPU tensors) calls the scan and
the step ``selective_scan_fn`` and ``selective_state_update``, takes the causal conv from a
cache (``_causal_conv1d_cache``) and takes its kernel path only when ``is_fast_path_available``
and the weights are on CUDA; ``patch_transformers`` sets whichever of these the installed module
has. Usage::

    import selective_scan.hf
    selective_scan.hf.patch_transformers()
    model = transformers.MambaForCausalLM.from_pretrained(...)  # now runs on our ops
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable

MODULE = "transformers.models.mamba.modeling_mamba"

# For each of our functions, the globals that name it in some transformers version.
_GLOBALS = {
    "selective_scan_fn": ("mamba_selective_scan", "selective_scan_fn"),
    "selective_state_update": ("mamba_selective_state_update", "selective_state_update"),
    "mamba_inner_fn": ("mamba_inner_fn",),
    "causal_conv1d_fn": ("causal_conv1d_fn",),
    "causal_conv1d_update": ("causal_conv1d_update",),
}
# The module's globals as they were before the first patch, to restore them.
_originals: dict[str, dict[str, object]] = {}  # module name -> {global name: original}


def _declared_kwargs_only(fn: Callable) -> Callable:
    """fn, dropping keyword arguments it does not declare, as transformers' own kernel hooks do
    (``use_kernel_func_from_hub_with_fallback``): the mixer passes implementation hints such as
    ``use_mambapy`` to the scan and its own ``**kwargs`` to the conv."""
    declared = frozenset(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in declared})

    return call


@functools.cache
def _ours() -> dict[str, Callable]:
    """Our implementations, imported on first use, once (so repeated patches set the same
    objects)."""
    from .conv import causal_conv1d_fn, causal_conv1d_update
    from .interface import selective_scan_fn
    from .mamba_inner import mamba_inner_fn
    from .state_update import selective_state_update

    return {
        "selective_scan_fn": _declared_kwargs_only(selective_scan_fn),
        "selective_state_update": selective_state_update,
        "mamba_inner_fn": mamba_inner_fn,
        "causal_conv1d_fn": _declared_kwargs_only(causal_conv1d_fn),
        "causal_conv1d_update": causal_conv1d_update,
    }


def patch_transformers(module_name: str = MODULE) -> dict[str, Callable]:
    """Point transformers' Mamba model (``MambaMixer``) at selective_scan's functions: the scan,
    the decode step, the causal conv and its update, and the fused ``mamba_inner_fn``.

    Patches the module's globals, so models created before and after the call use them.
    Idempotent; ``unpatch_transformers`` undoes it. Returns {global name: the value now there}
    (our functions; on transformers 4 also the conv cache and the fast-path flag). Raises
    ImportError without transformers, RuntimeError if the installed version's module lacks one
    of the hooks. ``module_name``: the module holding the mixer's globals.
    """
    module = importlib.import_module(module_name)
    ours = _ours()
    patched = {}
    for role, names in _GLOBALS.items():
        patched |= {name: ours[role] for name in names if hasattr(module, name)}
    covered = {role for role, names in _GLOBALS.items() if any(n in patched for n in names)}
    # transformers 4.5x: the causal conv comes from a cache filled on first use.
    if hasattr(module, "_causal_conv1d_cache"):
        patched["_causal_conv1d_cache"] = (ours["causal_conv1d_update"], ours["causal_conv1d_fn"])
        covered |= {"causal_conv1d_fn", "causal_conv1d_update"}
    # Older transformers 4: a module-level flag gates the kernel path.
    if hasattr(module, "is_fast_path_available"):
        patched["is_fast_path_available"] = True
    missing = [names for role, names in _GLOBALS.items() if role not in covered]
    if missing:
        raise RuntimeError(
            f"selective_scan.hf: {module_name} has none of {missing}; this transformers version "
            "looks its Mamba kernels up under other names, so it cannot be patched"
        )
    originals = _originals.setdefault(module_name, {})
    for name, value in patched.items():
        originals.setdefault(name, getattr(module, name))
        setattr(module, name, value)
    return patched


def unpatch_transformers(module_name: str = MODULE) -> list[str]:
    """Restore the globals ``patch_transformers`` replaced; returns their names."""
    module = importlib.import_module(module_name)
    originals = _originals.pop(module_name, {})
    for name, value in originals.items():
        setattr(module, name, value)
    return list(originals)
