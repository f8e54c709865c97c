"""A cached launcher for Triton kernels: after the first launch of a specialisation, launch the
compiled kernel directly.

``JITFunction.run`` (triton 3.6 and 3.9 alike) binds every argument, computes a specialisation
key (dtype and 16-byte alignment of each pointer, ``== 1`` / ``% 16`` of each int, the constexpr
values, the options), looks the compiled kernel up, builds launch metadata for the hooks and
finally calls ``CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *bound_args)``. That costs tens of microseconds of
Python per launch, which makes an eager step of a few hundred launches CPU-bound.

:class:`CachedLauncher` keeps, per wrapper object, a dict from a key of its own — at least as
fine as Triton's: tensor dtype and alignment, for ints ``== 1``, ``% 16`` and the 32/64-bit
range, constexpr values by value, every keyword (constexprs and launch options), the current
device — to ``(launcher, function, packed_metadata, tail)``, where ``tail`` is the values of
the parameters the call did not pass positionally (keywords and defaults, in signature order).
A hit calls the compiled launcher with the same positional arguments ``JITFunction.run`` would
pass. A miss (and anything unusual: interpreter mode, launch hooks registered, an argument type
outside tensor/int/float/bool/None, a triton whose internals do not look as expected) takes the
normal ``kernel[grid](...)`` path, and so does every launch with
``INFIRE_TRITON_FAST_LAUNCH=0``; on a miss the binder's own argument list is compared with
ours before the entry is kept, and any disagreement turns the fast path off for that kernel.
Launch hooks registered after a specialisation was cached are not called for its cached launches.

Programmatic dependent launch (PDL, Hopper and newer): a kernel made with ``CachedLauncher(fn,
pdl=True)`` takes a ``PDL`` constexpr and begins with :func:`pdl_entry`; when :func:`pdl_on`, it is
launched with ``launch_pdl=True``, so its programs are resident and waiting (``griddepcontrol.wait``)
while the kernel before it in the stream finishes, instead of being launched after it. A decode
step at one row is some 400 kernels of a few microseconds each, in a CUDA graph: the launch gap
between them is a measured part of the step (docs/perf.md, "PDL"). Every PDL kernel waits before
it reads or writes anything, so a kernel after it sees all that came before, PDL or not.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# INFIRE_TRITON_FAST_LAUNCH=0 (a debug escape hatch, read once at import): every launch takes
# Triton's own path.
_FAST_LAUNCH = os.environ.get("INFIRE_TRITON_FAST_LAUNCH", "1") != "0"

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
_FLOAT = ("f",)
_NONE = ("n",)


def _same(x: Any, y: Any) -> bool:
    return x is y or (type(x) is type(y) and not isinstance(x, torch.Tensor) and x == y)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Whether PDL kernels are launched as such (None: not decided yet); a benchmark comparing both
# sets it before a model loads (graphs keep what they captured).
PDL_ON: bool | None = None


def pdl_on() -> bool:
    """Whether compiled PDL kernels get programmatic dependent launch: decided at the first such
    launch, from the current device (compute capability 9.0 or newer)."""
    global PDL_ON
    if PDL_ON is None:
        PDL_ON = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    return PDL_ON


@triton.jit
def pdl_entry(PDL: tl.constexpr):
    """The first statement of a PDL kernel: wait until the kernel before it has finished and its
    writes are visible, then let the next kernel's programs be scheduled."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


class CachedLauncher:
    """Wraps one ``@triton.jit`` function; ``launch(grid, *args, **kwargs)`` is ``fn[grid](*args, **kwargs)``.

    Call sites pass the kernel's leading parameters positionally and the rest (constexprs,
    ``num_warps``...) as keywords, the same keywords in the same order every time.
    """

    def __init__(self, fn: Any, pdl: bool = False) -> None:
        self.fn = fn
        # The kernel runs compiled (not under TRITON_INTERPRET, which triton decides when the
        # kernel is decorated): only then can it wait on its predecessor or hold inline assembly.
        self.compiled = hasattr(fn, "device_caches")
        # the kernel has a PDL constexpr and begins with pdl_entry
        self.pdl = pdl
        self._cache: dict[tuple, tuple] = {}
        self._stream = None
        self._device = None
        # False: every launch takes the normal path (INFIRE_TRITON_FAST_LAUNCH=0 at import, or a
        # disagreement found at a miss)
        self.enabled = _FAST_LAUNCH
        self.hits = 0
        self.misses = 0
        try:
            params = list(fn.params)
            self._names = [p.name for p in params]
            self._constexpr = [bool(p.is_constexpr) for p in params]
            self._defaults = [p.default if p.has_default else _NONE for p in params]
            self._has_default = [bool(p.has_default) for p in params]
            fn.device_caches  # noqa: B018 - only JITFunction has it (not the interpreter's wrapper)
        except AttributeError:
            self.enabled = False
            self._names, self._constexpr = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, *args, **kwargs)

    def _key(self, args: tuple, kwargs: dict) -> tuple | None:
        spec: list = [self._device(), tuple(kwargs.items())]
        cexpr = self._constexpr
        for i, a in enumerate(args):
            t = type(a)
            if cexpr[i]:
                spec.append(("c", a))
            elif t is torch.Tensor or isinstance(a, torch.Tensor):
                spec.append((a.dtype, not a.data_ptr() & 15))
            elif t is int:
                spec.append(1 if a == 1 else (not a & 15, _I32_MIN <= a <= _I32_MAX, a < (1 << 63)))
            elif t is float:
                spec.append(_FLOAT)
            elif t is bool:
                spec.append(("b", a))
            elif a is None:
                spec.append(_NONE)
            else:
                return None
        return tuple(spec)

    def launch(self, grid: tuple, *args, **kwargs) -> None:
        if self.pdl:
            kwargs = ({**kwargs, "PDL": True, "launch_pdl": True} if self.compiled and pdl_on()
                      else {**kwargs, "PDL": False})
        key = None
        if self.enabled and self._stream is not None and len(args) <= len(self._names):
            key = self._key(args, kwargs)
            hit = self._cache.get(key) if key is not None else None
            if hit is not None:
                run, function, meta, tail, dev = hit
                self.hits += 1
                n = len(grid)
                run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._stream(dev), function, meta,
                    None, None, None, *args, *tail)
                return
        kernel = self.fn[grid](*args, **kwargs)
        self.misses += 1
        if self.enabled and not _interpreting():
            self._remember(key, kernel, args, kwargs)

    def _hooks_off(self) -> bool:
        from triton import knobs

        rt = knobs.runtime
        for h in (getattr(rt, "launch_enter_hook", None), getattr(rt, "launch_exit_hook", None)):
            if h is not None and (not hasattr(h, "calls") or h.calls):
                return False
        return True

    def _remember(self, key: tuple | None, kernel: Any, args: tuple, kwargs: dict) -> None:
        """Keep ``kernel`` under ``key`` when the binder agrees with our argument list; else turn off."""
        try:
            if self._stream is None:
                from triton.runtime import driver

                self._device = driver.active.get_current_device
                self._stream = driver.active.get_current_stream
                if key is None and len(args) <= len(self._names):
                    key = self._key(args, kwargs)
            if key is None or not self._hooks_off():
                return
            names = self._names
            tail = []
            for i in range(len(args), len(names)):
                if names[i] in kwargs:
                    tail.append(kwargs[names[i]])
                elif self._has_default[i]:
                    tail.append(self._defaults[i])
                else:
                    self.enabled = False
                    return
            dev = self._device()
            binder = self.fn.device_caches[dev][-1]
            bound = binder(*args, **kwargs)[0]
            full = (*args, *tail)
            vals = list(bound.values())
            if len(vals) != len(full) or not all(_same(x, y) for x, y in zip(vals, full)):
                self.enabled = False
                return
            run, function, meta = kernel.run, kernel.function, kernel.packed_metadata
            if function is None or not callable(run):
                self.enabled = False
                return
            self._cache[key] = (run, function, meta, tuple(tail), dev)
        except Exception:  # any surprise in triton's internals: the normal launch path only
            self.enabled = False
