"""Two changes to Triton 3.6's interpreter that make the kernels' CPU tests several times faster
and leave every value they compute as it was (conftest.py installs them under the interpreter).

- The interpreter patches triton.language (inspect.getmembers over its modules) at each launch,
  and again at every call of a @triton.jit helper inside the launch, where the modules the
  helper sees are most often patched already and the pass changes nothing. Such calls skip it;
  a helper that sees a module the launch left unpatched (triton's own helpers see
  triton.language.core) still patches.
- tl.associative_scan with a combine function of its own ran the combine once per element, on
  scalars. It runs once per position along the scan's axis here, on the whole slice: the same
  elementwise operations in the same order, on every element at once.
"""

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def _patch_unless_patched(patch_lang):
    seen = {}  # fn -> the language modules its globals hold

    def patch(fn):
        if fn not in seen:
            seen[fn] = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        langs = seen[fn]
        if any(tl.core.is_builtin(lang.load) for lang in langs) or (
            tl in langs and tl.core.is_builtin(tl.math.exp)
        ):
            return patch_lang(fn)
        return interpreter._LangPatchScope()

    return patch


def _scan_by_slices(self, inputs):
    """ScanOps.generic_scan's results: a scan along self.axis of the tuple of tensors."""
    data = [t.handle.data for t in inputs]
    dtypes = [t.dtype for t in inputs]
    outs = [np.empty_like(d) for d in data]
    lead = (slice(None),) * self.axis
    for k in range(data[0].shape[self.axis]):
        x = [d[(*lead, k)] for d in data]
        if k:  # the carry as generic_scan has it: read back from the outputs, in their dtypes
            prev = [out[(*lead, k - 1)] for out in outs]
            args = [self.to_tensor(v, t) for v, t in zip(prev + x, dtypes * 2, strict=True)]
            x = self.combine_fn.fn(*args)
            x = [a.handle.data if isinstance(a, tl.core.tensor) else a
                 for a in (x if isinstance(x, tuple) else (x,))]  # fmt: skip
        for out, v in zip(outs, x, strict=True):
            out[(*lead, k)] = v
    return [self.to_tensor(out, t) for out, t in zip(outs, dtypes, strict=True)]


# Written against Triton 3.6's interpreter (the version the tests pin); elsewhere nothing changes.
APPLIES = hasattr(interpreter, "_patch_lang") and hasattr(
    getattr(interpreter, "ScanOps", None), "generic_scan"
)
ORIGINAL_SCAN = interpreter.ScanOps.generic_scan if APPLIES else None


def install() -> None:
    if APPLIES:
        interpreter._patch_lang = _patch_unless_patched(interpreter._patch_lang)
        interpreter.ScanOps.generic_scan = _scan_by_slices
