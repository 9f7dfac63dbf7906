"""Checks for lesson 6's exercises: harness kernels that call the learner's Triton code, and diagnoses.

The exercises (``grading/source/06_paged_attention_kernel.ipynb``) ask for three pieces of decode
version 1 and 2:

1. ``kv_block_offsets`` -- a ``@triton.jit`` function: the block-table address computation;
2. ``paged_decode_v1_kernel`` -- the kernel's online-softmax loop over the blocks;
3. ``load_query_group`` -- a ``@triton.jit`` function: GQA packing, the query heads of one KV head's group.

A learner's ``@triton.jit`` function cannot be called from Python; it is handed to a harness kernel here as
a ``tl.constexpr`` argument and called inside it. The launches happen in *scenarios* (the ``drive_*``
functions, run by :func:`pagedkv.grading.checks.drive` where the learner's code lives: the sandbox under
``pagedkv grade``, the notebook's kernel in a check cell): each receives the learner's kernel and plain inputs
(tensors, shapes), refuses anything that is not a real Triton kernel, launches, and returns what came out
(tensors), or a record of the launch that raised or ran too long. The checks (``check_*``) make the inputs,
compute the float64 reference of ``pagedkv.attention`` themselves, on random shapes, and turn the typical
mistakes into a message that names the case, what was expected and what came back (via
``pagedkv.grading.checks.fail``, so the notebook's check cell and ``pagedkv grade`` show the same text). Every
kernel launch runs under a time limit.
"""

from __future__ import annotations

import math
import types

import torch
import triton
import triton.language as tl

from pagedkv.attention import make_paged_kv, ref_paged_attention_decode, relative_error

LOG2E = 1.4426950408889634  # log2(e): qk_scale = softmax scale * LOG2E, so the kernels use exp2

LAUNCH_TIMEOUT = 120.0  # seconds for one launch in the interpreter
TOL = {torch.float32: 1e-4, torch.float16: 3e-3}
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _dtype(dtype) -> torch.dtype:
    """Accept "fp32"/"fp16" (what the exercise tests pass) or a torch dtype."""
    return _DTYPES[dtype] if isinstance(dtype, str) else dtype


def _fail(message: str) -> None:
    from pagedkv.grading.checks import fail

    fail(message)


def _drive_timeout(launches: int) -> float:
    """The time limit of a scenario that makes ``launches`` launches (each has its own, :data:`LAUNCH_TIMEOUT`)."""
    return LAUNCH_TIMEOUT * launches + 30.0


# ------------------------------------------------------------------------------------------------------------
# what the scenarios share: the kernel's type, one launch as a record
# ------------------------------------------------------------------------------------------------------------


def kernel_refusal(fn) -> str | None:
    """None when ``fn`` is a real Triton kernel: what ``@triton.jit`` makes (``JITFunction`` compiled,
    ``InterpretedFunction`` under ``TRITON_INTERPRET=1``), with Triton's own launch and call. Otherwise what it
    is instead (its type's name), for the refusal: an object that looks like a kernel (a ``.fn`` and ``[grid]``
    that compute the answer in PyTorch) is not one. A scenario asks this before it launches anything."""
    from triton.runtime.jit import JITFunction

    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - a Triton without the interpreter
        InterpretedFunction = JITFunction  # noqa: N806
    kind = type(fn)
    if kind is not JITFunction and kind is not InterpretedFunction:
        return kind.__name__
    for attr in ("run", "__getitem__", "__call__"):  # Triton's own, not replaced by the notebook
        module = getattr(getattr(kind, attr, None), "__module__", None) or ""
        if not module.startswith("triton."):
            return f"{kind.__name__} whose {attr} is not Triton's"
    if not isinstance(getattr(fn, "fn", None), types.FunctionType):
        return f"{kind.__name__} around a {type(getattr(fn, 'fn', None)).__name__}"
    return None


def _attempt(launch, *args, **kwargs) -> dict | None:
    """Run ``launch(*args, **kwargs)`` (a kernel launch) under :data:`LAUNCH_TIMEOUT`: None when it returned, else
    a record of what went wrong (``{"timed_out": True}``, or ``{"raised": type name, "message": ...}``), as
    data."""
    from pagedkv.grading.checks import CallTimeout, time_limit

    try:
        with time_limit(LAUNCH_TIMEOUT, "the launch"):
            launch(*args, **kwargs)
    except CallTimeout:
        return {"timed_out": True}
    except Exception as exc:  # noqa: BLE001 - the learner's error, whatever it is, is reported by the check
        try:
            message = str(exc)
        except Exception:  # noqa: BLE001 - an exception whose str() raises
            message = ""
        return {"raised": type(exc).__name__, "message": message[:4000], "where": _error_line(exc)}
    return None


def _error_line(exc: BaseException) -> str:
    """Where a launch's error came from, as ' (in f: out = acc / l_i)': the learner's innermost statement, or
    else the line of this module's harness kernel that used what the learner's function returned (Triton's
    interpreter raises ``InterpreterError`` from the error it ran into, whose traceback holds the kernel's
    frames). Empty when neither is known. No line number: under ``pagedkv grade`` the kernels are compiled from
    the notebook's source in one file (``kernel_source``), so the number would not be the cell's."""
    import traceback

    from pagedkv.grading.checks import statement_text

    cause = exc.__cause__ or exc
    try:
        frames = traceback.extract_tb(cause.__traceback__)
    except Exception:  # noqa: BLE001 - a traceback that cannot be read: say nothing
        return ""
    here = __file__.removesuffix("c")  # this module's source, not its .pyc
    harness = None
    for frame in reversed(frames):
        name = frame.filename or ""
        if name == here:
            harness = harness or frame
            continue
        if any(part in name for part in ("site-packages", "dist-packages", "/pagedkv/", "/triton/", "/lib/python")) or (
                name.endswith("_interpreter.py")):
            continue  # Python's, Triton's or the library's own frames
        code = statement_text(frame)
        return f" (in {frame.name}: {code})" if code else f" (in {frame.name})"
    if harness is not None:
        return (f" (in the check's kernel {harness.name}, which uses what your function returned: "
                f"{statement_text(harness)})")
    return ""


def _launch_failed(what: str, record: dict, shapes: str = "") -> None:
    """Fail with what went wrong in the launch ``record`` describes (:func:`_attempt`), if anything did.
    ``shapes``: what the function must return, said when the error is a shape mismatch."""
    if record.get("timed_out"):
        _fail(f"{what} did not finish within {LAUNCH_TIMEOUT:g} s: is there a loop that never ends?")
    if "raised" in record:
        text = str(record.get("message") or "").strip().splitlines()
        first = " ".join(text[:3])[:500] if text else ""
        stub = "NoneType" in first or "Ellipsis" in first or "ellipsis" in first
        hint = (" Is the function still the stub (...)? It must `return` what the exercise asks for."
                if stub else "")
        if not hint and ("make_shape_compatible" in first or "incompatible dimensions" in first):
            hint = (" Two tensors of different shapes met: "
                    + (shapes if shapes else "check each tile's shape (x[:, None] is a column, x[None, :] a row)")
                    + ".")
        where = str(record.get("where") or "")[:600]
        _fail(f"{what} raised {record['raised']}: {first}{where}.{hint}")


def _require_jit(fn, name: str) -> None:
    """Fail unless ``fn`` may be a kernel (defined, callable, not the library's): the trusted side's part of the
    test. Whether it is a real ``@triton.jit`` kernel is asked where it lives, by the scenario
    (:func:`kernel_refusal`), whose record :func:`_refused` reads."""
    from pagedkv.grading.checks import require_function

    require_function(fn, name)


def _refused(record, name: str) -> None:
    """Fail if the scenario refused the learner's ``name`` (not a real Triton kernel)."""
    if not isinstance(record, dict):
        _fail(f"the test of {name} got {type(record).__name__} back from its scenario, expected a dict")
    if "refused" in record:
        _fail(f"{name} must be decorated with @triton.jit (it is a {record['refused']})")


def _cases(record: dict, cases: list, name: str) -> list:
    """The scenario's per-case records, before the comparisons: a list of dicts, no more than ``cases``
    (:func:`~pagedkv.grading.checks.scenario_records`; a shorter one ends with a failure; :func:`_all_seen`
    counts them after)."""
    from pagedkv.grading.checks import scenario_records

    return scenario_records(record.get("cases"), f"the test of {name}", at_most=len(cases), unit="records")


def _all_seen(record: dict, cases: list, name: str) -> None:
    """After the comparisons: fail unless the scenario's record held every case (a shorter one ends with a
    failure, which has failed the test before this)."""
    from pagedkv.grading.checks import all_came_back

    all_came_back(record["cases"], len(cases), "cases", f"the test of {name}")


def _padded(t: torch.Tensor, fill: float, slack: int | None = None) -> torch.Tensor:
    """A copy of ``t`` that lives in the middle of a larger buffer filled with ``fill``.

    The interpreter does not bounds-check pointers: a learner's address that is off by a block or a row would
    read or write whatever memory is there, and can crash the notebook's kernel. With ``slack`` elements of
    padding on both sides (default: twice the tensor, at least 64 Ki elements) such mistakes land in the
    padding, and come back as a wrong answer with a message instead of a crash.
    """
    n = t.numel()
    slack = max(2 * n, 1 << 16) if slack is None else slack
    buf = torch.full((slack + n + slack,), fill, dtype=t.dtype, device=t.device)
    view = buf[slack : slack + n].view(t.shape)
    view.copy_(t)
    return view


@triton.jit
def _probe_all_offsets_kernel(
    offsets_out_ptr,  # [B, max_blocks, Hkv, BLOCK_SIZE] int64: the offset of each slot's element d = 0
    mask_out_ptr,  # [B, max_blocks, Hkv, BLOCK_SIZE] int32
    block_tables_ptr, seq_lens_ptr,
    stride_kb, stride_kt, stride_kh, stride_bt,
    OFFSETS_FN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    offsets, mask = OFFSETS_FN(block_tables_ptr + b * stride_bt, j, seq_len, h, stride_kb, stride_kt, stride_kh,
                               BLOCK_SIZE, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    row = ((b * tl.num_programs(1) + j) * tl.num_programs(2) + h) * BLOCK_SIZE
    lo = tl.min(offsets, axis=1)  # [BLOCK_SIZE]: the lowest and highest address of each slot's row
    hi = tl.max(offsets, axis=1)
    tl.store(offsets_out_ptr + 2 * (row + t), lo.to(tl.int64))
    tl.store(offsets_out_ptr + 2 * (row + t) + 1, hi.to(tl.int64))
    tl.store(mask_out_ptr + row + t, mask.to(tl.int32))


def offsets_outside(bounds: torch.Tensor, masks: torch.Tensor, numel: int) -> torch.Tensor:
    """Where ``bounds`` (lowest, highest offset of each slot's row, from :data:`_probe_all_offsets_kernel`) of a
    slot the mask lets through lie outside a cache of ``numel`` elements: [B, max_blocks, Hkv, BLOCK_SIZE] bool.
    A scenario asks this before it loads through the learner's offsets (a load there would read memory that is
    not the cache, and can crash the process); the check asks it again to say where."""
    live = masks.bool()
    return live & ((bounds[..., 0] < 0) | (bounds[..., 1] >= numel))


# -------------------------------------------------------------------------------------------------------------
# exercise 1: kv_block_offsets
# -------------------------------------------------------------------------------------------------------------


@triton.jit
def _probe_offsets_kernel(
    offsets_out_ptr,  # [num_j, BLOCK_SIZE, HEAD_DIM] int64
    mask_out_ptr,  # [num_j, BLOCK_SIZE] int32
    table_ptr,  # [num_j] int32: a block table row
    seq_len,
    kv_head,
    stride_kb, stride_kt, stride_kh,
    OFFSETS_FN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    j = tl.program_id(0)
    offsets, mask = OFFSETS_FN(table_ptr, j, seq_len, kv_head, stride_kb, stride_kt, stride_kh, BLOCK_SIZE, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    tl.store(offsets_out_ptr + j * BLOCK_SIZE * HEAD_DIM + t[:, None] * HEAD_DIM + d[None, :], offsets)
    tl.store(mask_out_ptr + j * BLOCK_SIZE + t, mask.to(tl.int32))


@triton.jit
def _gather_kernel(
    out_ptr,  # [B, max_blocks * BLOCK_SIZE, Hkv, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, HEAD_DIM]
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    stride_ob, stride_ot, stride_oh,
    OFFSETS_FN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    offsets, mask = OFFSETS_FN(block_tables_ptr + b * stride_bt, j, seq_len, h, stride_kb, stride_kt, stride_kh,
                               BLOCK_SIZE, HEAD_DIM)
    tile = tl.load(k_cache_ptr + offsets, mask=mask[:, None], other=0.0)
    t = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    dst = b * stride_ob + (j * BLOCK_SIZE + t[:, None]) * stride_ot + h * stride_oh + d[None, :]
    tl.store(out_ptr + dst, tile)


_OFFSETS_SHAPES = ("kv_block_offsets must return (offsets, mask), in this order: offsets of shape [BLOCK_SIZE, "
                   "HEAD_DIM] (slot t's row, HEAD_DIM values), mask of shape [BLOCK_SIZE] (one boolean per slot)")
_GROUP_SHAPES = ("load_query_group must return (q, heads, row_mask), in this order: q of shape [BLOCK_G, HEAD_DIM], "
                 "heads and row_mask of shape [BLOCK_G]")


def _expected_offsets(table: list[int], seq_len: int, kv_head: int, strides, block_size: int, head_dim: int):
    sb, st, sh = strides
    phys = torch.tensor(table, dtype=torch.int64)[:, None, None]
    t = torch.arange(block_size, dtype=torch.int64)[None, :, None]
    d = torch.arange(head_dim, dtype=torch.int64)[None, None, :]
    offsets = phys * sb + t * st + kv_head * sh + d  # [num_j, BS, D]
    pos = torch.arange(len(table))[:, None] * block_size + torch.arange(block_size)[None, :]
    return offsets, (pos < seq_len)


def drive_offsets_probe(kv_block_offsets, cases) -> dict:
    """Scenario: the learner's ``kv_block_offsets`` in :data:`_probe_offsets_kernel`, once per case
    ``(block_size, head_dim, kv_head, seq_len, table, strides)``. The record: ``{"refused": type name}`` for
    anything that is not a Triton kernel, else ``{"cases": [...]}``, each ``{"offsets": [num_j, BLOCK_SIZE,
    HEAD_DIM] int64, "mask": [num_j, BLOCK_SIZE] int32}`` read back, or the record of a launch that failed
    (:func:`_attempt`), the last one then."""
    refusal = kernel_refusal(kv_block_offsets)
    if refusal is not None:
        return {"refused": refusal}
    out = []
    for block_size, head_dim, kv_head, seq_len, table, strides in cases:
        num_j = len(table)
        offs = torch.full((num_j, block_size, head_dim), -1, dtype=torch.int64)
        mask = torch.full((num_j, block_size), -1, dtype=torch.int32)
        tab = _padded(torch.tensor(table, dtype=torch.int32), 0)
        failed = _attempt(_probe_offsets_kernel[(num_j,)], offs, mask, tab, seq_len, kv_head, *strides,
                          OFFSETS_FN=kv_block_offsets, BLOCK_SIZE=block_size, HEAD_DIM=head_dim)
        if failed is not None:
            out.append(failed)
            break
        out.append({"offsets": offs, "mask": mask})
    return {"cases": out}


def check_kv_block_offsets_probe(kv_block_offsets, seed: int = 0, part: str = "both") -> None:
    """Offsets and mask, read back directly, with strides and block ids large enough to overflow int32.

    ``part``: "offsets" checks the offsets alone, "mask" the mask alone, "both" the mask then the offsets (so
    that each half of the exercise can earn its point on its own)."""
    if part not in ("both", "offsets", "mask"):
        raise ValueError(f"part must be 'both', 'offsets' or 'mask', got {part!r}")
    from pagedkv.grading.checks import drive

    _require_jit(kv_block_offsets, "kv_block_offsets")
    gen = torch.Generator().manual_seed(seed)
    shapes = [
        # (block_size, head_dim, num_kv_heads, seq_len, num_j)
        (16, 64, 8, 37, 4),
        (8, 16, 2, 16, 3),
        (4, 32, 4, 1, 2),
        (16, 128, 8, 64, 5),
    ]
    cases = []
    for block_size, head_dim, hkv, seq_len, num_j in shapes:
        kv_head = int(torch.randint(0, hkv, (1,), generator=gen))
        strides = (block_size * hkv * head_dim, hkv * head_dim, head_dim)
        # Block ids near 9 million: id * stride is past 2**31 for every case, so int32 arithmetic wraps around.
        table = (torch.randperm(num_j, generator=gen) * 1000 + 9_000_000).tolist()
        cases.append((block_size, head_dim, kv_head, seq_len, table, strides))
    record = drive(drive_offsets_probe, kv_block_offsets, cases, timeout=_drive_timeout(len(cases)),
                   name="kv_block_offsets")
    _refused(record, "kv_block_offsets")
    seen = _cases(record, cases, "kv_block_offsets")
    for (block_size, head_dim, kv_head, seq_len, table, strides), rec in zip(cases, seen, strict=False):
        _launch_failed(f"kv_block_offsets (block_size={block_size}, head_dim={head_dim})", rec, _OFFSETS_SHAPES)
        offs, mask = rec["offsets"], rec["mask"]
        want_offs, want_mask = _expected_offsets(table, seq_len, kv_head, strides, block_size, head_dim)
        where = (f"with block_size={block_size}, head_dim={head_dim}, kv_head={kv_head}, seq_len={seq_len}, "
                 f"block table {table}, strides (block, token, head) = {strides}")
        got_mask = mask.bool()
        if part != "offsets" and not torch.equal(got_mask, want_mask):
            j = int((got_mask != want_mask).any(1).nonzero()[0, 0])
            why = ""
            extra = (torch.arange(block_size) + j * block_size == seq_len) & got_mask[j]
            last = (torch.arange(block_size) + j * block_size == seq_len - 1) & ~got_mask[j]
            if bool(got_mask[j].all()) and j > 0:
                why = (f" Your mask lets every slot of block j={j} through, but only positions < seq_len hold tokens: "
                       "compare the token's *logical position* j * BLOCK_SIZE + slot with seq_len (not the slot "
                       "index alone)")  # before the `<=` test: slot seq_len - j·bs may be in it too
            elif bool((got_mask[j] == (torch.arange(block_size) < seq_len)).all()) and j > 0:
                why = (" Your mask compares the slot index with seq_len; compare the token's *logical position* "
                       "j * BLOCK_SIZE + slot")
            elif bool(extra.any()):
                why = (f" Token {seq_len} is one past the sequence's end (positions 0..{seq_len - 1} exist): "
                       "use `<`, not `<=`")
            elif bool(last.any()):
                why = (f" Position {seq_len - 1}, the sequence's last token, is masked off: a slot holds a real "
                       "token when j * BLOCK_SIZE + slot < seq_len (positions 0..seq_len-1), with nothing added or "
                       "subtracted")
            else:
                why = (" Slot t of logical block j holds the token at position j * BLOCK_SIZE + t; the mask is "
                       "True where that position is < seq_len")
            _fail(f"kv_block_offsets mask for logical block j={j} is {got_mask[j].int().tolist()}, expected "
                  f"{want_mask[j].int().tolist()} ({where}).{why}")
        if part != "mask" and not torch.equal(offs, want_offs):
            bad = (offs != want_offs).nonzero()[0].tolist()
            j, t, dd = bad
            got, want = int(offs[j, t, dd]), int(want_offs[j, t, dd])
            why = ""
            wrapped = ((want + 2**31) % 2**32) - 2**31
            if got == wrapped or got < 0:
                why = (" The value wrapped around int32: cast the block id to int64 before multiplying "
                       "(`tl.load(...).to(tl.int64)`): the offsets, counted in elements, pass 2**31")
            elif got == j * strides[0] + t * strides[1] + kv_head * strides[2] + dd:
                why = (" That is the offset of *physical* block j: look the physical block up in the block table "
                       "(`tl.load(table_row_ptr + j)`)")
            elif got - want == (-kv_head * strides[2]):
                why = " The KV head's offset (kv_head * stride_kh) is missing"
            elif got == table[j] * strides[0] + t * strides[2] + kv_head * strides[1] + dd or (
                    got == table[j] * strides[0] + t * strides[1] + kv_head * strides[1] + dd):
                why = (" The slot and the KV head take different strides: slot t moves by stride_kt, the KV head "
                       "by stride_kh")
            elif dd > 0 and got == int(offs[j, t, 0]):
                why = (f" Every dim of slot {t} has the same offset: add the column of dims, d[None, :] with "
                       "d = tl.arange(0, HEAD_DIM)")
            elif (got - t * strides[1] - kv_head * strides[2] - dd) % strides[0] == 0:
                block = (got - t * strides[1] - kv_head * strides[2] - dd) // strides[0]
                why = (f" That is physical block {block}, not block_table[{j}] = {table[j]}: table_row_ptr points "
                       "at this sequence's row of the table, whose entry j is at table_row_ptr + j")
            _fail(f"kv_block_offsets offset for logical block j={j}, slot {t}, dim {dd} is {got}, expected {want} "
                  f"(= block_table[{j}]={table[j]} * {strides[0]} + {t} * {strides[1]} + {kv_head} * {strides[2]} "
                  f"+ {dd}; {where}).{why}")
    _all_seen(record, cases, "kv_block_offsets")


def drive_offsets_gather(kv_block_offsets, cases) -> dict:
    """Scenario: gather whole sequences out of a shuffled cache with the learner's ``kv_block_offsets``, once per
    case ``(key_cache, block_tables, seq_lens)``. First the offsets alone (:data:`_probe_all_offsets_kernel`:
    stored, nothing loaded through them), then, only when every slot the mask lets through is inside the cache,
    the gather (:data:`_gather_kernel`). The record: ``{"refused": type name}``, or ``{"cases": [...]}``, each
    ``{"bounds": [B, max_blocks, Hkv, BLOCK_SIZE, 2] int64, "masks": ... int32, "out": [B, max_blocks *
    BLOCK_SIZE, Hkv, D]}`` (no ``"out"`` when the offsets point outside the cache: the last case then), or the
    record of a launch that failed (:func:`_attempt`), the last one then."""
    refusal = kernel_refusal(kv_block_offsets)
    if refusal is not None:
        return {"refused": refusal}
    out_cases: list[dict] = []
    for key_cache, block_tables, seq_lens in cases:
        batch, max_blocks = block_tables.shape
        _, block_size, hkv, d = key_cache.shape
        bounds = torch.zeros(batch, max_blocks, hkv, block_size, 2, dtype=torch.int64)
        masks = torch.zeros(batch, max_blocks, hkv, block_size, dtype=torch.int32)
        table = _padded(block_tables, 0)
        failed = _attempt(_probe_all_offsets_kernel[(batch, max_blocks, hkv)],
                          bounds, masks, table, seq_lens.clone(), key_cache.stride(0), key_cache.stride(1),
                          key_cache.stride(2), table.stride(0), OFFSETS_FN=kv_block_offsets, BLOCK_SIZE=block_size,
                          HEAD_DIM=d)
        if failed is not None:
            out_cases.append(failed)
            break
        record: dict = {"bounds": bounds, "masks": masks}
        out_cases.append(record)
        if bool(offsets_outside(bounds, masks, key_cache.numel()).any()):
            break  # loading there would read memory that is not the cache
        kc, bt = _padded(key_cache, float("nan")), _padded(block_tables, 0)
        out = torch.full((batch, max_blocks * block_size, hkv, d), float("nan"), dtype=key_cache.dtype)
        failed = _attempt(_gather_kernel[(batch, max_blocks, hkv)],
                          out, kc, bt, seq_lens.clone(), kc.stride(0), kc.stride(1), kc.stride(2), bt.stride(0),
                          out.stride(0), out.stride(1), out.stride(2),
                          OFFSETS_FN=kv_block_offsets, BLOCK_SIZE=block_size, HEAD_DIM=d)
        if failed is not None:
            record.update(failed)
            break
        record["out"] = out
    return {"cases": out_cases}


def check_kv_block_offsets_gather(kv_block_offsets, seed: int = 0, block_sizes=(16, 8), dtype=torch.float32) -> None:
    """Use the learner's offsets to gather whole sequences out of a shuffled cache; compare with torch."""
    from pagedkv.grading.checks import drive

    _require_jit(kv_block_offsets, "kv_block_offsets")
    dtype = _dtype(dtype)
    gen = torch.Generator().manual_seed(seed)
    hkv, d = 2, 32
    cases, all_lens = [], []
    for block_size in block_sizes:
        lens = [1, block_size, block_size + 1, 3 * block_size - 1] + torch.randint(1, 5 * block_size, (2,),
                                                                                   generator=gen).tolist()
        kc, vc, bt, sl = make_paged_kv(lens, hkv, d, block_size, dtype=dtype, generator=gen)
        cases.append((kc, bt, sl))
        all_lens.append(lens)
    record = drive(drive_offsets_gather, kv_block_offsets, cases, timeout=_drive_timeout(2 * len(cases)),
                   name="kv_block_offsets")
    _refused(record, "kv_block_offsets")
    for (kc, bt, _), lens, rec in zip(cases, all_lens, _cases(record, cases, "kv_block_offsets"), strict=False):
        block_size = kc.shape[1]
        what = f"gathering with kv_block_offsets (block_size={block_size})"
        if "bounds" not in rec:
            _launch_failed(what, rec, _OFFSETS_SHAPES)
        bounds = rec["bounds"]
        outside = offsets_outside(bounds, rec["masks"], kc.numel())
        if bool(outside.any()):
            b, j, h, t = outside.nonzero()[0].tolist()
            _fail(f"{what}: kv_block_offsets gives addresses {bounds[b, j, h, t].tolist()} (lowest, highest) for "
                  f"sequence {b}, logical block {j}, KV head {h}, slot {t}, but the cache has only {kc.numel()} "
                  f"elements (shape {tuple(kc.shape)}, strides {kc.stride()[:3]}). Loading there would read memory "
                  "that is not the cache; check which stride multiplies what")
        _launch_failed(what, rec, _OFFSETS_SHAPES)
        max_blocks = bt.shape[1]
        out = rec["out"]
        for b, n in enumerate(lens):
            want = torch.zeros(max_blocks * block_size, hkv, d, dtype=dtype)
            for t in range(n):
                want[t] = kc[int(bt[b, t // block_size]), t % block_size]
            got = out[b]
            if not torch.equal(got, want):
                bad = (got != want) | torch.isnan(got)
                t = int(bad.any(2).any(1).nonzero()[0, 0])
                h = int(bad[t].any(1).nonzero()[0, 0])
                if t >= n:
                    why = (f"token {t} is past the sequence's end ({n} tokens) and must be masked off "
                           f"(loaded as 0), but your mask let the load through (it read {got[t, h, 0].item():.4g}, "
                           "a value from a slot this sequence does not own)")
                else:
                    why = (f"token {t} (logical block {t // block_size}, slot {t % block_size}, which lives in "
                           "physical "
                           f"block {int(bt[b, t // block_size])}) came back as {got[t, h, :3].tolist()}..., expected "
                           f"{want[t, h, :3].tolist()}...")
                _fail(f"gathering sequence {b} (seq_len={n}, block_size={block_size}, kv head {h}, its block table "
                      f"{bt[b, : math.ceil(n / block_size)].tolist()}) with kv_block_offsets: {why}")
    _all_seen(record, cases, "kv_block_offsets")


# -------------------------------------------------------------------------------------------------------------
# exercise 2: the online-softmax loop of paged_decode_v1_kernel
# -------------------------------------------------------------------------------------------------------------


@triton.jit
def reference_kv_block_offsets(table_row_ptr, j, seq_len, kv_head, stride_kb, stride_kt, stride_kh,
                               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Exercise 1's answer: what exercise 2's checks plug into the learner's loop, so that a mistake in
    exercise 1 costs no points in exercise 2 (the grader keeps it out of the learner's reach)."""
    physical = tl.load(table_row_ptr + j).to(tl.int64)
    slot = tl.arange(0, BLOCK_SIZE)
    d = tl.arange(0, HEAD_DIM)
    offsets = physical * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
    mask = j * BLOCK_SIZE + slot < seq_len
    return offsets, mask


def with_reference_offsets(kernel, offsets_fn=None):
    """A copy of the learner's ``paged_decode_v1_kernel`` whose ``kv_block_offsets`` is ``offsets_fn`` (by default
    exercise 1's answer, :func:`reference_kv_block_offsets`).

    The kernel's Python function is rebuilt with the same code over a copy of its globals (the notebook's
    namespace, untouched) in which ``kv_block_offsets`` is ``offsets_fn``, and jitted again: the interpreter and
    the compiler both resolve called functions through those globals, and the copy, a new kernel, has a
    compilation cache of its own (the learner's kernel, compiled with its own ``kv_block_offsets``, neither
    serves the copy nor keeps what the copy compiled). Anything that is not a ``@triton.jit`` kernel comes back
    as it is."""
    fn = getattr(kernel, "fn", None)
    if not isinstance(fn, types.FunctionType):
        return kernel
    namespace = dict(fn.__globals__)
    namespace["kv_block_offsets"] = reference_kv_block_offsets if offsets_fn is None else offsets_fn
    clone = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__qualname__, clone.__module__, clone.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    clone.__annotations__ = dict(getattr(fn, "__annotations__", {}))
    return triton.jit(clone)


def drive_decode_v1(kernel, query, key_cache, value_cache, block_tables, seq_lens, offsets_fn=None) -> dict:
    """Scenario: the learner's ``paged_decode_v1_kernel`` on one batch, with ``offsets_fn`` in place of the
    learner's ``kv_block_offsets`` (by default exercise 1's answer, :func:`reference_kv_block_offsets`, which
    this exercise's sandbox has as the library's: :func:`with_reference_offsets`), on padded copies of the
    inputs (what the kernel writes into them stays there). The record: ``{"refused": type name}`` for anything
    that is not a Triton kernel, ``{"out": [B, Hq, D]}``, or the record of a launch that failed
    (:func:`_attempt`)."""
    refusal = kernel_refusal(kernel)
    if refusal is not None:
        return {"refused": refusal}
    launched = with_reference_offsets(kernel, offsets_fn)
    qp = _padded(query, float("nan"))
    kcp, vcp, btp = _padded(key_cache, float("nan")), _padded(value_cache, float("nan")), _padded(block_tables, 0)
    out = _padded(torch.full_like(query, float("nan")), float("nan"))
    failed = _attempt(launch_learner_decode_v1, launched, qp, kcp, vcp, btp, seq_lens.clone(), out=out)
    return failed if failed is not None else {"out": out.clone()}


def launch_learner_decode_v1(kernel, query, key_cache, value_cache, block_tables, seq_lens, scale=None, out=None):
    """Launch the exercise's ``paged_decode_v1_kernel(out, q, k_cache, v_cache, block_tables, seq_lens, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, GROUP, BLOCK_SIZE, HEAD_DIM)``; grid (B, Hq)."""
    batch, hq, d = query.shape
    _, block_size, hkv, _ = key_cache.shape
    scale = d**-0.5 if scale is None else scale
    out = torch.empty_like(query) if out is None else out
    kernel[(batch, hq)](
        out, query, key_cache, value_cache, block_tables, seq_lens, scale * LOG2E,
        query.stride(0), query.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        GROUP=hq // hkv, BLOCK_SIZE=block_size, HEAD_DIM=d,
    )
    return out


def _short(row: torch.Tensor) -> str:
    return f"{[round(x, 4) for x in row[:4].tolist()]}..."


def _row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per (sequence, head) relative error; NaN rows give inf.  -> [B, Hq]"""
    o, r = out.double(), ref.double()
    err = (o - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(1e-30)
    return torch.where(torch.isnan(o).any(-1), torch.full_like(err, math.inf), err)


def _attend_heads(q, kc, vc, bt, sl, kv_of) -> torch.Tensor:
    """Decode attention in float64 where query head h reads KV head ``kv_of(h)`` (NaN rows where that KV head does
    not exist): what a kernel with another head mapping computes. The reference on caches whose head h is KV head
    ``kv_of(h)``. -> [B, Hq, D]"""
    hkv = kc.shape[2]
    heads = [kv_of(h) for h in range(q.shape[1])]
    idx = torch.tensor([g if 0 <= g < hkv else 0 for g in heads])
    out = ref_paged_attention_decode(q, kc[:, :, idx], vc[:, :, idx], bt, sl, compute_dtype=torch.float64)
    out[:, [h for h, g in enumerate(heads) if not 0 <= g < hkv]] = math.nan
    return out


def _head_mapping_hint(out, ref, q, kc, vc, bt, sl, tol: float) -> str:
    """A hint when the output is attention with another query-head -> KV-head mapping than h // GROUP."""
    hq, hkv = q.shape[1], kc.shape[2]
    group = hq // hkv
    # Mappings defined for every head first: the identity reads KV heads that do not exist (rows not checked).
    mappings = [(f"h % GROUP (h % {group})", lambda h: h % group),
                (f"h % num_kv_heads (h % {hkv}, interleaved)", lambda h: h % hkv),
                ("h, the query head itself", lambda h: h)]
    for words, kv_of in mappings:
        if all(kv_of(h) == h // group for h in range(hq) if kv_of(h) < hkv):
            continue
        alt = _attend_heads(q, kc, vc, bt, sl, kv_of)
        known = ~torch.isnan(alt).any(-1)  # [B, Hq]: the rows that read an existing KV head
        if bool(known.any()) and bool((_row_errors(out, alt)[known] < tol).all()):
            return (f"each query head h was attended with KV head {words}. Query head h reads KV head "
                    f"h // GROUP (kv_head, given at the top of the kernel): pass kv_head to kv_block_offsets")
    return ""


def _worst_factor(ratio: torch.Tensor) -> float:
    """The factor of ``ratio`` farthest from 1 (a row's got / expected)."""
    flat = ratio.reshape(-1)
    return float(flat[int((flat - 1).abs().argmax())])


def check_decode_v1(paged_decode_v1_kernel, seed: int = 0, block_size: int = 16, group: int = 2,
                    dtype=torch.float32, batch_extra: int = 2, env=None) -> None:
    """The learner's version-1 kernel against the float64 reference on a random ragged batch, run with exercise
    1's answer in place of the learner's ``kv_block_offsets`` (:func:`drive_decode_v1`). ``env`` (the test's
    namespace parameter) is not used: the scenario makes that swap itself."""
    from pagedkv.grading.checks import drive

    _require_jit(paged_decode_v1_kernel, "paged_decode_v1_kernel")
    dtype = _dtype(dtype)
    gen = torch.Generator().manual_seed(seed)
    hkv, d = 2, 32
    lens = [1, block_size, block_size + 1, 2 * block_size - 1, 4 * block_size]
    lens += torch.randint(2, 6 * block_size, (batch_extra,), generator=gen).tolist()
    # A wide block table (a column per token; the spare entries point at real blocks): a loop that runs
    # past the sequence's blocks reads masked slots of valid blocks instead of memory past the table.
    kc, vc, bt, sl = make_paged_kv(lens, hkv, d, block_size, dtype=dtype, generator=gen, max_blocks=max(lens))
    q = (2.0 * torch.randn(len(lens), hkv * group, d, generator=gen)).to(dtype)  # peaky scores: the max moves
    # The loop is judged with exercise 1's answer in place of the learner's kv_block_offsets (the scenario's
    # default): a mistake there is exercise 1's, and must not cost this exercise its points (nor read outside
    # the cache). The expected output is computed here, from the check's own tensors: the kernel gets copies.
    ref = ref_paged_attention_decode(q, kc, vc, bt, sl, compute_dtype=torch.float64)
    record = drive(drive_decode_v1, paged_decode_v1_kernel, q, kc, vc, bt, sl, timeout=_drive_timeout(1),
                   name="paged_decode_v1_kernel")
    _refused(record, "paged_decode_v1_kernel")
    _launch_failed("paged_decode_v1_kernel", record,
                   "in the loop, k and v are [BLOCK_SIZE, HEAD_DIM], q is [HEAD_DIM], the scores s and p are "
                   "[BLOCK_SIZE] (tl.sum(..., axis=1)), m_i and l_i are scalars (tl.max / tl.sum over axis=0) and acc "
                   "is [HEAD_DIM] (tl.sum(p[:, None] * v, axis=0))")
    out = record.get("out")
    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        _fail("the test of paged_decode_v1_kernel: the scenario's record is incomplete: its output came back as "
              f"{type(out).__name__} {str(out)[:80]}, expected a tensor of shape {tuple(ref.shape)}")
    err = relative_error(out, ref)
    if err < TOL[dtype]:
        return
    rows = _row_errors(out, ref)  # [B, Hq]
    bad_seq = (rows >= TOL[dtype]).any(1)
    b = int(bad_seq.nonzero()[0, 0])
    h = int((rows[b] >= TOL[dtype]).nonzero()[0, 0])
    case = (f"sequence {b} (seq_len={lens[b]}, block_size={block_size}), query head {h}: got "
            f"{_short(out[b, h])}, expected {_short(ref[b, h])}")
    single = torch.tensor([n <= block_size for n in lens])
    ragged = torch.tensor([n % block_size != 0 for n in lens])
    hint = ""
    nan_seq = torch.isnan(out.reshape(len(lens), -1)).any(1)  # [B]
    short = torch.tensor([n < block_size for n in lens])
    if bool(nan_seq.any()) and torch.equal(nan_seq, short) and not bool(short.all()):
        hint = ("exactly the sequences shorter than one block are NaN: acc / l_i = 0 / 0, so the loop ran zero "
                "times for them. The loop visits every block the sequence touches, the last one partly filled: "
                "tl.cdiv(seq_len, BLOCK_SIZE) of them, not seq_len // BLOCK_SIZE")
    elif mapping := _head_mapping_hint(out, ref, q, kc, vc, bt, sl, TOL[dtype]):
        hint = mapping
    elif torch.isnan(out).all():
        hint = ("every output is NaN. If the loop is still the stub (...), l_i stays 0 and acc / l_i is 0 / 0. If "
                "it is written, a NaN comes from inf / inf, 0 · inf or -inf - (-inf): m_i starts at -inf, so on the "
                "first block alpha = exp2(m_i - m_new) (old max minus new) must come out 0, and p = exp2(s - m_new) "
                "must use the new max m_new, never the old m_i")
    elif torch.isnan(out).any():
        hint = ("some outputs are NaN: exp2(-inf - (-inf)) is NaN. Start m_i at -inf, take the max with the block's "
                "scores first, and only then subtract")
    elif bool(bad_seq[single].any()) is False and bool(bad_seq[~single].any()):
        hint = ("sequences that fit in one block are right and longer ones are wrong: when a block raises the running "
                "max from m_i to m_new, multiply what you accumulated (both l_i and acc) by alpha = exp2(m_i - m_new), "
                "computed with the old m_i, before adding the new block; then set m_i = m_new for the next block")
    elif bool(bad_seq[ragged].any()) and not bool(bad_seq[~ragged].any()):
        hint = ("only sequences whose last block is partly filled are wrong: slots past seq_len hold another "
                "sequence's data (or garbage). Set their scores to -inf (tl.where(mask, s, float('-inf'))) and load "
                "them as 0")
    else:
        scale = d**-0.5
        alternatives = [
            (scale * LOG2E, "that is softmax(q·k · scale · log2(e)) with exp: qk_scale already holds log2(e), so use "
                            "tl.exp2 (exp2(x · log2 e) = exp(x))"),
            (1 / LOG2E, "that is softmax with the scores never multiplied by qk_scale: s = Σ_d k · q, times qk_scale"),
            (1.0, "that is softmax(q·k) with exp and no scale: multiply the scores by qk_scale and use tl.exp2"),
            (scale * scale * LOG2E, "the scores were multiplied by qk_scale twice: once is enough (it holds the "
                                    "softmax scale and log2(e) together)"),
        ]
        for alt_scale, words in alternatives:
            alt = ref_paged_attention_decode(q, kc, vc, bt, sl, scale=alt_scale, compute_dtype=torch.float64)
            if relative_error(out, alt) < 10 * TOL[dtype]:
                hint = words
                break
        else:
            r = out.double()
            ratio = (r * ref).sum(-1) / (ref * ref).sum(-1)  # [B, Hq]: the factor that fits each row best
            fit = _row_errors(ratio[..., None] * ref, r)
            if bool((fit[single] < TOL[dtype]).all()) and bool(((ratio[single] - 1).abs() > 10 * TOL[dtype]).any()):
                hint = ("the rows of the sequences that fit in one block are the right vectors times a wrong factor "
                        f"(up to {_worst_factor(ratio[single]):.4g}): the output is acc / l_i, divided by l_i exactly "
                        "once, after the loop (the given last lines do it); acc and l_i themselves stay sums")
            elif dtype == torch.float32 and err < 50 * TOL[dtype]:
                hint = ("the error is small but far above float32 rounding, as from float16 arithmetic: keep q, k, v, "
                        "p and the running values m_i, l_i, acc in float32")
    _fail(f"paged_decode_v1_kernel: relative error {err:.3g} (allowed {TOL[dtype]:g}); first wrong row: {case}."
          + (f" Hint: {hint}" + ("" if hint.endswith((".", "?", "!")) else ".") if hint else ""))


# -------------------------------------------------------------------------------------------------------------
# exercise 3: GQA packing (load_query_group)
# -------------------------------------------------------------------------------------------------------------


@triton.jit
def _probe_group_kernel(
    q_out_ptr,  # [Hkv, BLOCK_G, HEAD_DIM]
    heads_out_ptr,  # [Hkv, BLOCK_G] int32
    rows_out_ptr,  # [Hkv, BLOCK_G] int32
    q_ptr,
    b,
    stride_qb, stride_qh,
    LOAD_FN: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    kv_head = tl.program_id(0)
    q, heads, row_mask = LOAD_FN(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, BLOCK_G, HEAD_DIM)
    r = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    tl.store(q_out_ptr + kv_head * BLOCK_G * HEAD_DIM + r[:, None] * HEAD_DIM + d[None, :], q.to(tl.float32))
    tl.store(heads_out_ptr + kv_head * BLOCK_G + r, heads.to(tl.int32))
    tl.store(rows_out_ptr + kv_head * BLOCK_G + r, row_mask.to(tl.int32))


@triton.jit
def _decode_v2_harness(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
    LOAD_FN: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Version 2 of the lesson with the learner's ``load_query_group``; the rest is the library's."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    q, heads, row_mask = LOAD_FN(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, BLOCK_G, HEAD_DIM)
    q = q.to(k_cache_ptr.dtype.element_ty)  # a tile loaded as float32 (as version 1 loads q) is fine too
    offs_n = tl.arange(0, BLOCK_SIZE)
    offs_d = tl.arange(0, HEAD_DIM)
    seq_len = tl.load(seq_lens_ptr + b)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        physical = tl.load(block_tables_ptr + b * stride_bt + j).to(tl.int64)
        valid = j * BLOCK_SIZE + offs_n < seq_len
        offs = physical * stride_kb + offs_n[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None])


def launch_group_decode(load_query_group, query, key_cache, value_cache, block_tables, seq_lens, out=None):
    """Decode version 2 with the learner's ``load_query_group``; grid (B, Hkv)."""
    batch, hq, d = query.shape
    _, block_size, hkv, _ = key_cache.shape
    group = hq // hkv
    out = torch.empty_like(query) if out is None else out
    _decode_v2_harness[(batch, hkv)](
        out, query, key_cache, value_cache, block_tables, seq_lens, d**-0.5 * LOG2E,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0),
        LOAD_FN=load_query_group, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, HEAD_DIM=d,
    )
    return out


def drive_query_group_probe(load_query_group, num_kv_heads: int, cases) -> dict:
    """Scenario: the learner's ``load_query_group`` in :data:`_probe_group_kernel`, one program per KV head, once
    per case ``(group, block_g, b, query)`` (``query`` [batch, Hq, D] float32, Hq = num_kv_heads * group). The
    queries are put inside a much larger NaN-filled buffer: extra heads per row and extra rows, so that an
    unmasked or mis-addressed load reads NaN instead of memory that is not there. The record: ``{"refused":
    type name}``, or ``{"cases": [...]}``, each ``{"q": [Hkv, BLOCK_G, D], "heads": [Hkv, BLOCK_G] int32,
    "rows": [Hkv, BLOCK_G] int32}`` read back, or the record of a launch that failed (:func:`_attempt`), the
    last one then."""
    refusal = kernel_refusal(load_query_group)
    if refusal is not None:
        return {"refused": refusal}
    out = []
    for group, block_g, b, query in cases:
        batch, hq, d = query.shape
        pad_heads = (num_kv_heads + 2) * block_g
        # As many rows as heads and more: with the two strides swapped, head h reads row h.
        storage = torch.full((max(batch, hq) + block_g + 2, hq + pad_heads, d), float("nan"), dtype=query.dtype)
        storage[:batch, :hq] = query
        q = storage[:batch, :hq]
        q_out = torch.full((num_kv_heads, block_g, d), -7.0)
        heads = torch.full((num_kv_heads, block_g), -1, dtype=torch.int32)
        rows = torch.full((num_kv_heads, block_g), -1, dtype=torch.int32)
        failed = _attempt(_probe_group_kernel[(num_kv_heads,)], q_out, heads, rows, q, b, q.stride(0), q.stride(1),
                          LOAD_FN=load_query_group, GROUP=group, BLOCK_G=block_g, HEAD_DIM=d)
        if failed is not None:
            out.append(failed)
            break
        out.append({"q": q_out, "heads": heads, "rows": rows})
    return {"cases": out}


def check_query_group_probe(load_query_group, seed: int = 0, groups=(1, 2, 4, 8), num_kv_heads: int = 3) -> None:
    """The rows the learner's load_query_group returns: which query heads, which rows are real, their values."""
    from pagedkv.grading.checks import drive

    _require_jit(load_query_group, "load_query_group")
    gen = torch.Generator().manual_seed(seed)
    d = 16
    batch = 2
    cases = []
    for group in groups:
        hq = num_kv_heads * group
        block_g = max(16, triton.next_power_of_2(group))
        q = torch.randn(batch, hq, d, generator=gen)
        b = int(torch.randint(0, batch, (1,), generator=gen))
        cases.append((group, block_g, b, q))
    record = drive(drive_query_group_probe, load_query_group, num_kv_heads, cases,
                   timeout=_drive_timeout(len(cases)), name="load_query_group")
    _refused(record, "load_query_group")
    for (group, block_g, b, q), rec in zip(cases, _cases(record, cases, "load_query_group"), strict=False):
        hq = num_kv_heads * group
        _launch_failed(f"load_query_group (GROUP={group}, BLOCK_G={block_g})", rec, _GROUP_SHAPES)
        q_out, heads, rows = rec["q"], rec["heads"], rec["rows"]
        where = f"GROUP={group} (Hq={hq}, Hkv={num_kv_heads}), BLOCK_G={block_g}, sequence b={b}"
        for g in range(num_kv_heads):
            want_rows = [1 if r < group else 0 for r in range(block_g)]
            got_rows = [int(x != 0) for x in rows[g].tolist()]
            if got_rows != want_rows:
                order = ""
                if rows[g, :group].tolist() == [g * group + r for r in range(group)] and set(
                        heads[g].tolist()) <= {0, 1} and got_rows != [int(x != 0) for x in heads[g].tolist()]:
                    order = (". The second value you return holds the query heads and the third the row mask: return "
                             "them as q, heads, row_mask, in this order")
                _fail(f"load_query_group row mask for kv_head={g} is {got_rows}, expected {want_rows} ({where}): rows "
                      f"0..{group - 1} hold the group's query heads, rows {group}..{block_g - 1} are padding so that "
                      "tl.dot gets 16 rows, and must be masked off" + order)
            want_heads = [g * group + r for r in range(group)]
            got_heads = heads[g, :group].tolist()
            if got_heads != want_heads:
                why = ""
                if got_heads == [r * num_kv_heads + g for r in range(group)]:
                    why = (" That is the interleaved mapping h % num_kv_heads == kv_head. vLLM and Hugging Face give "
                           "each KV head a *contiguous* run of query heads: h // GROUP == kv_head")
                elif got_heads == [g * block_g + r for r in range(group)] and block_g != group:
                    why = (f" You multiplied by BLOCK_G ({block_g}), the padded tile height; the group has GROUP = "
                           f"{group} heads, so KV head g's heads start at g * GROUP")
                elif got_heads == [g + r for r in range(group)] and g > 0:
                    why = " KV head g's first query head is g * GROUP, not g"
                else:
                    why = (f" Row r of KV head g's tile is query head g * GROUP + r, here {g} * {group} + r for "
                           f"r = 0..{group - 1} (heads = kv_head * GROUP + tl.arange(0, BLOCK_G))")
                _fail(f"load_query_group heads for kv_head={g} are {got_heads}, expected {want_heads} ({where}).{why}")
            want_q = torch.zeros(block_g, d)
            want_q[:group] = q[b, g * group : (g + 1) * group]
            if torch.isnan(q_out[g]).any():
                r = int(torch.isnan(q_out[g]).any(1).nonzero()[0, 0])
                if r >= group:  # a padding row: the load was not masked with the row mask
                    _fail(f"load_query_group tile row {r} for kv_head={g} is a padding row (row >= GROUP = {group}) "
                          f"and read memory past the queries ({where}): load with mask=row_mask[:, None] and "
                          "other=0.0 so that padding rows are zeros")
                _fail(f"load_query_group tile row {r} for kv_head={g} (query head {g * group + r}) read memory "
                      f"outside the query tensor ({where}): its address is off. Row r of sequence b is at "
                      "q_ptr + b * stride_qb + heads[r] * stride_qh + d (check which stride multiplies what)")
            if not torch.allclose(q_out[g], want_q):
                r = int((~torch.isclose(q_out[g], want_q)).any(1).nonzero()[0, 0])
                what = "a padding row, which must be zeros (other=0.0)" if r >= group else f"query head {g * group + r}"
                _fail(f"load_query_group tile row {r} for kv_head={g} ({what}) is {q_out[g, r, :3].tolist()}..., "
                      f"expected {want_q[r, :3].tolist()}... ({where}); check the sequence offset b * stride_qb and "
                      "the head offset heads * stride_qh")
    _all_seen(record, cases, "load_query_group")


def drive_group_decode(load_query_group, cases) -> dict:
    """Scenario: decode version 2 (:func:`launch_group_decode`) with the learner's ``load_query_group``, once per
    case ``(query, key_cache, value_cache, block_tables, seq_lens)``. The output and the queries live inside wider
    buffers: the extra heads (and rows) of the output are canaries that a mis-addressed store would hit, those of
    the queries padding that a mis-addressed load reads instead of memory that is not there. The record:
    ``{"refused": type name}``, or ``{"cases": [...]}``, each ``{"wide": the whole output buffer
    [B + BLOCK_G + 2, Hq + (Hkv + 2) * BLOCK_G, D]}`` (the output is its ``[:B, :Hq]``), or the record of a
    launch that failed (:func:`_attempt`), the last one then."""
    refusal = kernel_refusal(load_query_group)
    if refusal is not None:
        return {"refused": refusal}
    out_cases = []
    for query, key_cache, value_cache, block_tables, seq_lens in cases:
        batch, hq, d = query.shape
        hkv = key_cache.shape[2]
        block_g = max(16, triton.next_power_of_2(hq // hkv))
        pad_heads = (hkv + 2) * block_g
        wide = torch.full((batch + block_g + 2, hq + pad_heads, d), float("nan"), dtype=query.dtype)
        out = wide[:batch, :hq]
        qwide = torch.zeros(max(batch, hq) + block_g + 2, hq + pad_heads, d, dtype=query.dtype)
        qwide[:batch, :hq] = query
        qv = qwide[:batch, :hq]
        failed = _attempt(launch_group_decode, load_query_group, qv, key_cache.clone(), value_cache.clone(),
                          block_tables.clone(), seq_lens.clone(), out)
        if failed is not None:
            out_cases.append(failed)
            break
        out_cases.append({"wide": wide})
    return {"cases": out_cases}


def check_group_decode(load_query_group, seed: int = 0, groups=(1, 2, 4, 8), num_kv_heads: int = 2,
                       dtype=torch.float32) -> None:
    """Decode version 2 with the learner's packing against the float64 reference; padding must stay unwritten.

    The rows are probed first (:func:`check_query_group_probe`), so that a wrong head, row mask or address is
    reported as such rather than as a wrong attention output."""
    from pagedkv.grading.checks import drive

    _require_jit(load_query_group, "load_query_group")
    check_query_group_probe(load_query_group, seed=seed, groups=groups, num_kv_heads=max(num_kv_heads, 1))
    dtype = _dtype(dtype)
    gen = torch.Generator().manual_seed(seed)
    block_size, d = 16, 32
    cases, all_lens = [], []
    for group in groups:
        lens = [1, 17] + torch.randint(1, 80, (2,), generator=gen).tolist()
        kc, vc, bt, sl = make_paged_kv(lens, num_kv_heads, d, block_size, dtype=dtype, generator=gen)
        q = torch.randn(len(lens), num_kv_heads * group, d, generator=gen).to(dtype)
        cases.append((q, kc, vc, bt, sl))
        all_lens.append(lens)
    # The expected outputs are computed here, from the check's own tensors (the kernel gets copies).
    refs = [ref_paged_attention_decode(q, kc, vc, bt, sl, compute_dtype=torch.float64) for q, kc, vc, bt, sl in cases]
    record = drive(drive_group_decode, load_query_group, cases, timeout=_drive_timeout(len(cases)),
                   name="load_query_group")
    _refused(record, "load_query_group")
    for group, lens, (q, kc, vc, bt, sl), ref, rec in zip(groups, all_lens, cases, refs,
                                                          _cases(record, cases, "load_query_group"),
                                                          strict=False):
        hq = num_kv_heads * group
        _launch_failed(f"decode version 2 with load_query_group (GROUP={group})", rec, _GROUP_SHAPES)
        wide = rec["wide"]
        out = wide[: len(lens), :hq]
        where = f"GROUP={group}, Hq={hq}, Hkv={num_kv_heads}, seq_lens={lens}"
        canaries = torch.ones_like(wide, dtype=torch.bool)
        canaries[: len(lens), :hq] = False
        if not torch.isnan(wide[canaries]).all():
            _fail(f"decode version 2 with your load_query_group wrote past the last query head ({where}): the padding "
                  "rows (row >= GROUP) must be masked off (row_mask False), or they overwrite other heads' outputs")
        err = relative_error(out, ref)
        if err >= TOL[dtype]:
            rows = _row_errors(out, ref)
            b, h = (rows >= TOL[dtype]).nonzero()[0].tolist()
            hint = ""
            if group > 1 and num_kv_heads > 1:
                # What the output would be with the interleaved mapping (query head h reads KV head h % Hkv).
                perm = torch.arange(hq).view(num_kv_heads, group).t().reshape(-1)  # h' -> head reading kv h' // group
                alt = ref_paged_attention_decode(q[:, perm], kc, vc, bt, sl, compute_dtype=torch.float64)
                alt_out = torch.empty_like(alt)
                alt_out[:, perm] = alt
                if relative_error(out, alt_out) < 10 * TOL[dtype]:
                    hint = (" Hint: each query head was attended with KV head h % num_kv_heads (interleaved); the "
                            "group of KV head g is the contiguous run g*GROUP .. g*GROUP+GROUP-1")
            _fail(f"decode version 2 with your load_query_group: relative error {err:.3g} ({where}); first wrong: "
                  f"sequence {b}, query head {h}, got {out[b, h, :3].tolist()}..., expected {ref[b, h, :3].tolist()}..."
                  + hint)
    _all_seen(record, cases, "load_query_group")
