"""engine.kernels._launch.CachedLauncher against a stand-in for triton's JITFunction (CPU only).

The stand-in records what a launch passes, so the test checks that a cached launch hands the
compiled launcher exactly the positional arguments JITFunction.run would (the binder's), that
every input triton specialises on (dtype, alignment, ints == 1 / % 16, constexpr values,
keywords) separates cache entries, and that disagreement or odd inputs fall back to the normal path.
"""

from __future__ import annotations

import inspect

import torch

from engine.kernels._launch import CachedLauncher

EMPTY = inspect.Parameter.empty


class _Param:
    def __init__(self, name, constexpr=False, default=EMPTY):
        self.name, self.is_constexpr, self.default = name, constexpr, default
        self.has_default = default is not EMPTY


class _Compiled:
    def __init__(self, log, tag):
        self.function, self.packed_metadata, self._log, self._tag = object(), ("meta", tag), log, tag

    @property
    def run(self):
        return lambda *a: self._log.append(("fast", self._tag, a))


class _FakeJit:
    """Params: x (ptr), n (int), s (float), BLOCK (constexpr), FLAG (constexpr, default True)."""

    def __init__(self, bad_binder=False):
        self.params = [_Param("x"), _Param("n"), _Param("s"), _Param("BLOCK", True), _Param("FLAG", True, True)]
        self.device_caches = {0: ({}, {}, None, None, self._binder)}
        self.log: list = []
        self.compiled = 0
        self.bad_binder = bad_binder

    def _binder(self, *args, **kwargs):
        names = [p.name for p in self.params]
        bound = dict(zip(names, args))
        for p in self.params[len(args):]:
            bound[p.name] = kwargs.get(p.name, p.default)
        if self.bad_binder:
            bound["FLAG"] = "other"
        return bound, None, None

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            self.compiled += 1
            k = _Compiled(self.log, self.compiled)
            self.log.append(("slow", grid, args, kwargs))
            return k
        return go


def _launcher(fn):
    lau = CachedLauncher(fn)
    lau._device, lau._stream = (lambda: 0), (lambda dev: 1234)
    return lau


def test_hit_passes_the_binders_arguments(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = _FakeJit()
    lau = _launcher(fn)
    x = torch.zeros(64)
    lau.launch((3,), x, 32, 0.5, BLOCK=128, num_warps=4)
    lau.launch((5, 2), x, 48, 0.25, BLOCK=128, num_warps=4)
    assert lau.misses == 1 and lau.hits == 1
    kind, tag, a = fn.log[-1]
    assert kind == "fast"
    assert a[:4] == (5, 2, 1, 1234) and a[5] == ("meta", tag) and a[6:9] == (None, None, None)
    assert a[9] is x and a[10:] == (48, 0.25, 128, True)


def test_every_specialisation_input_separates_entries(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = _FakeJit()
    lau = _launcher(fn)
    x = torch.zeros(64)
    calls = [
        ((x, 32, 0.5), dict(BLOCK=128)),
        ((x[1:], 32, 0.5), dict(BLOCK=128)),  # misaligned pointer
        ((x.double(), 32, 0.5), dict(BLOCK=128)),  # dtype
        ((x, 33, 0.5), dict(BLOCK=128)),  # not a multiple of 16
        ((x, 1, 0.5), dict(BLOCK=128)),  # == 1
        ((x, 1 << 40, 0.5), dict(BLOCK=128)),  # 64-bit
        ((x, 32, 0.5), dict(BLOCK=64)),  # constexpr value
        ((x, 32, 0.5), dict(BLOCK=128, FLAG=False)),  # defaulted constexpr given
        ((x, 32, 0.5), dict(BLOCK=128, num_warps=8)),  # launch option
        ((x, 32, 0.5, 256), {}),  # constexpr passed positionally: keyed by value
        ((x, 32, 0.5, 512), {}),
    ]
    for args, kw in calls:
        lau.launch((1,), *args, **kw)
    assert lau.misses == len(calls) and lau.hits == 0
    for args, kw in calls:
        lau.launch((1,), *args, **kw)
    assert lau.hits == len(calls) and fn.compiled == len(calls)


def test_fallbacks(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = _FakeJit(bad_binder=True)  # the binder disagrees with our argument list: fast path off
    lau = _launcher(fn)
    for _ in range(2):
        lau.launch((1,), torch.zeros(4), 16, 1.0, BLOCK=8)
    assert not lau.enabled and lau.hits == 0 and fn.compiled == 2
    fn = _FakeJit()
    lau = _launcher(fn)
    for _ in range(2):
        lau.launch((1,), torch.zeros(4), "odd", 1.0, BLOCK=8)  # an argument type triton keys differently
    assert lau.hits == 0 and fn.compiled == 2
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lau = _launcher(_FakeJit())
    for _ in range(2):
        lau.launch((1,), torch.zeros(4), 16, 1.0, BLOCK=8)
    assert lau.hits == 0


def test_not_a_jit_function_means_normal_launches():
    class Plain:
        def __getitem__(self, grid):
            return lambda *a, **k: ("ran", grid, a)

    lau = CachedLauncher(Plain())
    assert not lau.enabled
    lau.launch((2,), 1, 2)
    assert lau.misses == 1


def test_pdl_kernels_get_the_constexpr_and_the_launch_option(monkeypatch):
    """A PDL kernel is launched with PDL=True and launch_pdl=True where PDL is on, PDL=False
    (and no launch option) elsewhere; the two are separate specialisations."""
    from engine.kernels import _launch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = _FakeJit()
    fn.params.append(_Param("PDL", True))
    lau = _launcher(fn)
    lau.pdl = True
    x = torch.zeros(64)
    monkeypatch.setattr(_launch, "PDL_ON", False)
    lau.launch((1,), x, 32, 0.5, BLOCK=128)
    assert fn.log[-1][3] == {"BLOCK": 128, "PDL": False}
    monkeypatch.setattr(_launch, "PDL_ON", True)
    lau.launch((1,), x, 32, 0.5, BLOCK=128)
    assert fn.log[-1][3] == {"BLOCK": 128, "PDL": True, "launch_pdl": True}
    lau.launch((1,), x, 32, 0.5, BLOCK=128)
    assert lau.misses == 2 and lau.hits == 1 and fn.log[-1][2][-1] is True  # the PDL constexpr, in the tail


def test_every_engine_kernel_is_a_pdl_kernel():
    """Each launcher of the engine's kernels launches a kernel that waits on its predecessor (the
    sm_90 compile of each is checked for the wait in test_kernels_compile)."""
    import importlib

    mods = ["activation_triton", "attention_triton", "fp8_triton", "kv_write_triton", "norm_triton",
            "rope_triton", "sample_triton"]
    launchers = [v for m in mods for v in vars(importlib.import_module(f"engine.kernels.{m}")).values()
                 if isinstance(v, CachedLauncher)]
    assert len(launchers) >= 11
    for lau in launchers:
        assert lau.pdl and "PDL" in inspect.signature(lau.fn.fn).parameters, lau.fn
