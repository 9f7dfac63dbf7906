"""kernels/_interpreter.py: device-function calls inside an interpreted launch skip the repeated patch of
triton.language, and nothing else changes: the same outputs bit for bit, helpers that see triton.language.core
(tl.cdiv) still work, and the patch is counted once per launch."""

from __future__ import annotations

import inspect

import pagedkv.kernels as pk
import pytest
import torch
from pagedkv.kernels import decode_v3
from pagedkv.kernels._common import interpreter_on

from pagedkv.attention import make_paged_kv

pytestmark = pytest.mark.skipif(not interpreter_on(), reason="only Triton's interpreter is changed")


def _decode_all_versions() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    kc, vc, bt, sl = make_paged_kv([1, 17, 40], 2, 32, 16, generator=gen)
    q = torch.randn(3, 4, 32, generator=gen)
    outs = [pk.paged_attention_decode(q, kc, vc, bt, sl, version=v) for v in pk.DECODE_VERSIONS]
    outs.append(pk.paged_attention_decode(q, kc, vc, bt, sl, version=4, num_splits=3))
    return outs


def test_installed_once_and_results_are_bit_identical_without_it(monkeypatch):
    from pagedkv.kernels import _interpreter
    from triton.runtime import interpreter

    assert _interpreter.install() and _interpreter.install()  # installed on import, idempotent
    _interpreter._INSTALLED = False  # as in a fresh import of pagedkv.kernels: still installed only once
    before = interpreter.InterpretedFunction.__call__
    assert _interpreter.install() and interpreter.InterpretedFunction.__call__ is before
    fast = _decode_all_versions()
    calls = {"patch": 0}
    original_patch = interpreter._patch_lang

    def counting_patch(fn):
        calls["patch"] += 1
        return original_patch(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting_patch)
    with_shortcut = _decode_all_versions()
    patches_with = calls["patch"]
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", inspect.unwrap(interpreter.GridExecutor.__call__))
    monkeypatch.setattr(
        interpreter.InterpretedFunction, "__call__", inspect.unwrap(interpreter.InterpretedFunction.__call__)
    )
    calls["patch"] = 0
    slow = _decode_all_versions()
    patches_without = calls["patch"]
    for a, b, c in zip(fast, with_shortcut, slow, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c)
    # one patch per launch, plus one for the first tl.cdiv-like helper of a launch, instead of one per call of a
    # helper in every program of the grid
    assert 0 < 5 * patches_with < patches_without, (patches_with, patches_without)


def test_outside_a_launch_a_device_call_patches_as_before(monkeypatch):
    from pagedkv.kernels import _interpreter
    from triton.runtime import interpreter

    seen = []
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: seen.append(fn) or interpreter._LangPatchScope())
    assert _interpreter._launch_langs == []
    helper = decode_v3._attend_tiles
    with pytest.raises(Exception):  # noqa: B017 - a device function has no meaning outside a kernel
        helper()
    assert seen == [helper.fn]
