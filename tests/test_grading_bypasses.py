"""Answers that reach an exercise's answer through another part of the library score what the stub scores.

Each test grades, end to end (``pagedkv grade``), a copy of a set's exercise notebook whose answer cells were
written by an adversarial learner: they implement nothing, and reach the answer through a library function
that is not the exercise's reference but computes the same thing (a lesson module's expected-value helper, the
engine's copy of the arithmetic, another kernel's inner loop, the checks themselves replayed with recording
stand-ins for ``expect_equal``). The fix is each time a line in the set's ``reference:`` list (in
``grading/source/NN_*.ipynb``), which hides the symbol in that exercise's sandbox. Where one answer cell tries
several routes in turn (each route a fallback of the previous one), any route left open gives full marks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from grade_variant import grade_variant

ROOT = Path(__file__).resolve().parents[1]

# The learner's replay of a lesson's checks: each check runs with stand-ins for the expect_* helpers it
# imported, which record the expected value of every call instead of comparing; the answer is then a lookup.
ORACLE = '''
def _replay_checks(module, checks):
    import importlib
    mod = importlib.import_module(module)
    table, raises = {}, {}

    def key(args):
        return repr(tuple(list(a) if isinstance(a, (tuple, range)) else a for a in args))

    stand_ins = {
        "expect_equal": lambda fn, args, expected, *a, **k: table.__setitem__(key(args), expected),
        "expect_raises": lambda exc, fn, args, *a, **k: raises.__setitem__(key(args), exc),
        "run": lambda *a, **k: None, "require_function": lambda *a, **k: None, "fail": lambda *a, **k: None,
    }
    saved = {name: getattr(mod, name) for name in stand_ins if hasattr(mod, name)}
    for name in saved:
        setattr(mod, name, stand_ins[name])
    try:
        for check in checks:
            try:
                getattr(mod, check)(lambda *a, **k: None)
            except BaseException:
                pass
    finally:
        for name, value in saved.items():
            setattr(mod, name, value)

    def answer(*args):
        if key(args) in raises:
            raise raises[key(args)]("refused")
        return table[key(args)]

    return answer
'''


# A set-03 pool whose only work of its own is popping blocks: the eviction is reached in the library ({evict}).
EVICTING_POOL = '''class EvictingBlockPool(BlockPool):
    def free_blocks(self, ordered_blocks):
        ...

    def get_new_blocks(self, num_blocks):
        if num_blocks < 0 or num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError("no")
        blocks = [self.free_block_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            block.ref_cnt = 1
        {evict}
        return blocks
'''


# --------------------------------------------------------------------------------------------------- set 01
SET01 = {
    # cdiv (math_utils; also reached as kv_cache_manager.cdiv) is blocks_needed without the checks;
    # then the checks' own expected values
    "blocks_needed": ORACLE + '''
_replayed_bn = _replay_checks("pagedkv.grading.lessons.l01_fragmentation",
                           ["check_blocks_needed_examples", "check_blocks_needed_random", "check_blocks_needed_hidden"])


def blocks_needed(num_tokens, block_size):
    from pagedkv.kv_cache_manager import cdiv
    if num_tokens < 0 or block_size < 1:
        raise ValueError("no")
    try:
        return cdiv(num_tokens, block_size)
    except RuntimeError:
        return _replayed_bn(num_tokens, block_size)
''',
    "contiguous_capacity": ORACLE + '''
_replayed_cc = _replay_checks("pagedkv.grading.lessons.l01_fragmentation",
                           ["check_contiguous_capacity_examples", "check_contiguous_capacity_hidden"])


def contiguous_capacity(pool_blocks, max_len, block_size):
    return _replayed_cc(pool_blocks, max_len, block_size)
''',
    "paged_admission": ORACLE + '''
_replayed_pa = _replay_checks("pagedkv.grading.lessons.l01_fragmentation", [
    "check_paged_admission_fcfs", "check_paged_admission_skip", "check_paged_admission_boundary",
    "check_paged_admission_errors", "check_paged_admission_hidden"])


def paged_admission(lens, pool_blocks, block_size, policy="fcfs"):
    return _replayed_pa(list(lens), pool_blocks, block_size, policy)
''',
    # the lesson module's expected-value helper, not the reference's name
    "waste_percent": ORACLE + '''
_replayed_wp = _replay_checks("pagedkv.grading.lessons.l01_fragmentation",
                           ["check_waste_percent_examples", "check_waste_percent_hidden"])


def waste_percent(lens, block_size):
    from pagedkv.grading.lessons.l01_fragmentation import waste_reference
    lens = list(lens)
    if block_size < 1 or any(n < 0 for n in lens):
        raise ValueError("no")
    try:
        return waste_reference(lens, block_size)
    except RuntimeError:
        return _replayed_wp(lens, block_size)
''',
}


@pytest.mark.slow
def test_set01_answers_reached_through_the_library_or_the_checks_score_0(tmp_path):
    """Before the fix: blocks_needed 3/3 (``kv_cache_manager.cdiv``, or the checks replayed), contiguous_capacity
    2/2 (the checks replayed: they compute the expected value inline), waste_percent 2/2 (the lesson module's
    ``waste_reference``)."""
    scores = grade_variant(tmp_path, "01_fragmentation", SET01)
    assert scores == {"blocks_needed": 0, "contiguous_capacity": 0, "paged_admission": 0, "waste_percent": 0}, scores


# --------------------------------------------------------------------------------------------------- set 02
SET02 = {
    # the lesson module's expected slots, then the engine's prepare_inputs, one position at a time
    "slot_mapping": '''def slot_mapping(block_table, positions, block_size):
    positions = list(positions)
    if block_size < 1 or any(p < 0 or p >= len(block_table) * block_size for p in positions):
        raise ValueError("no")
    try:
        from pagedkv.grading.lessons.l02_block_pool import reference
        return reference(list(block_table), positions, block_size)
    except RuntimeError:
        from pagedkv.engine.model_runner import prepare_inputs
        from pagedkv.sched_output import SchedulerOutput
        out = []
        for p in positions:
            step = SchedulerOutput(num_scheduled_tokens={"r": 1}, num_computed_tokens={"r": p},
                                   block_tables={"r": list(block_table)})
            out += prepare_inputs(step, {"r": [0] * (p + 1)}, block_size).slot_mapping
        return out
''',
}


@pytest.mark.slow
def test_set02_slot_mapping_reached_through_the_library_scores_0(tmp_path):
    """Before the fix: slot_mapping 2/2 through ``l02_block_pool.reference`` or through the engine's
    ``prepare_inputs`` (``pagedkv.engine.model_runner``), both of which compute the slots."""
    scores = grade_variant(tmp_path, "02_block_pool", SET02)
    assert scores["slot_mapping"] == 0, scores


# --------------------------------------------------------------------------------------------------- set 03
SET03 = {
    # the per-block hash of the chain, called by a name the checks' co_names test does not see
    "hash_chain": '''def hash_chain(token_ids, block_size, hash_fn=builtin_hash, extra_keys=None):
    import pagedkv.kv_cache_utils as utils
    hash_one = getattr(utils, "hash_" + "block_tokens")
    if block_size < 1:
        raise ValueError("no")
    out, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash_one(hash_fn, parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys)
        out.append(parent)
    return out
''',
    # eviction done by the pool's public evict_blocks (free_blocks left as the stub)
    "EvictingBlockPool": EVICTING_POOL.format(
        evict='getattr(self, "evict" + "_blocks")([block.block_id for block in blocks])'),
}


@pytest.mark.slow
def test_set03_answers_reached_through_the_library_score_0(tmp_path):
    """Before the fix: hash_chain 3/3 through ``kv_cache_utils.hash_block_tokens`` (the checks refuse it by
    name only, in ``co_names``), eviction_on_reuse 1/5 with a get_new_blocks that evicts with the pool's public
    ``evict_blocks``."""
    scores = grade_variant(tmp_path, "03_prefix_caching", SET03)
    assert scores["hash_chain"] == 0 and scores["eviction_on_reuse"] == 0, scores


# --------------------------------------------------------------------------------------------------- set 04
SET04 = {
    "select_victim": '''def select_victim(running, policy):
    from pagedkv.grading.lessons import l04_scheduling
    return l04_scheduling.expected_victim(running, policy)
''',
}


@pytest.mark.slow
def test_set04_select_victim_reached_through_the_lesson_module_scores_0(tmp_path):
    """Before the fix: select_victim 2/2 through ``l04_scheduling.expected_victim``, the checks' rule."""
    scores = grade_variant(tmp_path, "04_scheduling", SET04)
    assert scores["select_victim"] == 0, scores


# --------------------------------------------------------------------------------------------------- set 06
# A "kernel" the checks accept (callable, with a callable .fn, launched with [grid]) that tries the library's
# attention routes in turn: a real @triton.jit kernel whose loop is decode v3's _attend_tiles, then every
# library function that computes paged decode attention. Any route left open writes the right output.
SET06 = {
    "paged_decode_v1_kernel": '''from pagedkv.kernels.decode_v3 import _attend_tiles


@triton.jit
def _v1_through_v3(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_d).to(tl.float32)
    rows = tl.arange(0, 16)
    tile = tl.zeros([16, HEAD_DIM], tl.float32) + q[None, :]
    acc, m, l = _attend_tiles(tile, k_cache_ptr, v_cache_ptr, block_tables_ptr + b * stride_bt, h // GROUP, seq_len,
                              0, tl.cdiv(seq_len, 16), qk_scale, stride_kb, stride_kt, stride_kh,
                              16, BLOCK_SIZE, 16, HEAD_DIM, HEAD_DIM, "ieee")
    out = tl.sum(tl.where(rows[:, None] == 0, acc, 0.0), axis=0) / tl.sum(tl.where(rows == 0, l, 0.0), axis=0)
    tl.store(out_ptr + b * stride_qb + h * stride_qh + offs_d, out.to(out_ptr.dtype.element_ty))


class _Launcher:
    def __call__(self, *args, **kwargs):
        raise RuntimeError("launch it with [grid]")

    def fn(self):
        pass

    def __getitem__(self, grid):
        def launch(out, query, key_cache, value_cache, block_tables, seq_lens, qk_scale, *rest, **kw):
            import pagedkv.attention as A

            scale, n = qk_scale / LOG2E, seq_lens.tolist()
            qsl = torch.arange(len(n) + 1, dtype=torch.int32)

            def own_kernel():
                _v1_through_v3[grid](out, query, key_cache, value_cache, block_tables, seq_lens, qk_scale, *rest, **kw)

            def decode(version):
                from pagedkv.kernels.decode import paged_attention_decode
                return paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale,
                                              version=version)

            def prefill_kernel():
                from pagedkv.kernels.prefill import paged_prefill_attention
                return paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, qsl, scale)

            def per_sequence(attend):
                return torch.stack([attend(b, *A.gather_kv(key_cache, value_cache, block_tables[b], n[b]))
                                    for b in range(len(n))])

            def dense(b, k, v):
                return A.attention(query[b][None], k, v, scale)[0]

            def engine(b, k, v):
                from pagedkv.engine.attention import _attend
                return _attend(query[b][None, None], k[None], v[None], torch.ones(1, 1, n[b], dtype=torch.bool),
                               scale)[0, 0]

            def bench(b, k, v):
                from pagedkv.kernels.bench import _gather_sdpa
                return _gather_sdpa(query[b:b + 1], key_cache, value_cache, block_tables[b:b + 1], n[b], scale)[0]

            routes = [
                own_kernel,
                lambda: A.ref_paged_attention_decode(query, key_cache, value_cache, block_tables, seq_lens, scale),
                lambda: decode(2), lambda: decode(3), lambda: decode(4),
                lambda: A.ref_paged_prefill_attention(query, key_cache, value_cache, block_tables, seq_lens, qsl,
                                                      scale),
                prefill_kernel,
                lambda: per_sequence(dense), lambda: per_sequence(engine), lambda: per_sequence(bench),
            ]
            for route in routes:
                try:
                    got = route()
                except Exception:
                    continue
                if got is None:  # the kernel wrote out itself
                    if not torch.isnan(out[: len(n)]).any():
                        return
                    continue
                out[: len(n)].copy_(got.to(out.dtype))
                return
        return launch


paged_decode_v1_kernel = _Launcher()
''',
}


@pytest.mark.slow
def test_set06_decode_loop_reached_through_another_kernel_or_reference_scores_0(tmp_path):
    """Before the fix: paged_decode_v1_kernel 3/3 with a loop that is decode v3's ``_attend_tiles`` (a real
    ``@triton.jit`` kernel), or with an object that launches like a kernel and returns the library's attention
    (``ref_paged_attention_decode``, another version of the decode kernel, the prefill kernel or reference, the
    dense ``attention`` of lesson 6's module, the engine's ``_attend``, the benchmark's ``_gather_sdpa``)."""
    scores = grade_variant(tmp_path, "06_paged_attention_kernel", SET06)
    assert scores["paged_decode_v1_kernel"] == 0, scores


@pytest.mark.slow
def test_set06_an_object_that_launches_like_a_kernel_scores_0(tmp_path):
    """paged_decode_v1_kernel must be a Triton kernel: a callable object with a ``.fn`` and ``[grid]`` that computes
    the attention in PyTorch scored 3/3 (the check asked only for a callable ``.fn``)."""
    fake = (
        "class _Launcher:\n"
        "    fn = print  # a callable .fn, as a kernel has\n"
        "    def __call__(self, *args, **kwargs):\n"
        "        raise TypeError('launch me with [grid]')\n"
        "    def __getitem__(self, grid):\n"
        "        def launch(out, q, kc, vc, bt, sl, qk_scale, *strides, GROUP, BLOCK_SIZE, HEAD_DIM):\n"
        "            scale = qk_scale / 1.4426950408889634\n"
        "            for b in range(q.shape[0]):\n"
        "                n = int(sl[b])\n"
        "                blocks = bt[b, : -(-n // BLOCK_SIZE)].long()\n"
        "                k = kc[blocks].reshape(-1, kc.shape[2], kc.shape[3])[:n].float()\n"
        "                v = vc[blocks].reshape(-1, vc.shape[2], vc.shape[3])[:n].float()\n"
        "                for h in range(q.shape[1]):\n"
        "                    w = ((k[:, h // GROUP] @ q[b, h].float()) * scale).softmax(0)\n"
        "                    out[b, h] = (w @ v[:, h // GROUP]).to(out.dtype)\n"
        "        return launch\n"
        "\n"
        "paged_decode_v1_kernel = _Launcher()\n"
    )
    scores = grade_variant(tmp_path, "06_paged_attention_kernel", {"paged_decode_v1_kernel": fake})
    assert scores["paged_decode_v1_kernel"] == 0, scores


# --------------------------------------------------------------------------------------------------- set 07
# paged_attention with the cache write written out and the attention taken from the library (ROUTE).
SET07_ATTENTION = '''def paged_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    import pagedkv.attention
    import pagedkv.engine.attention

    meta = kwargs["pagedkv_metadata"]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    kc, vc = meta.kv_caches[module.layer_idx]
    hkv, d = kc.shape[2], kc.shape[3]
    kc.view(-1, hkv, d)[meta.slot_mapping] = k
    vc.view(-1, hkv, d)[meta.slot_mapping] = v
    out = ROUTE
    return out.to(query.dtype)[None], None
'''
SET07_ROUTES = {
    "torch_paged_attention": "pagedkv.engine.attention.torch_paged_attention(q, kc, vc, meta, scaling)",
    "ref_paged_prefill_attention": "pagedkv.attention.ref_paged_prefill_attention(q, kc, vc, meta.block_tables, "
                                   "meta.seq_lens, meta.query_start_loc, scaling)",
    # the engine's write-then-attend that both model paths call, and the compiled CPU attention (every row)
    "engine_paged_attention": "pagedkv.engine.attention.paged_attention(q, k, v, module.layer_idx, meta, scaling)",
    "cpu_kernel": "pagedkv.engine.cpu_kernel.decode_attention(q.contiguous(), kc, vc, meta.block_tables, "
                  "meta.seq_lens, meta.query_start_loc, torch.arange(len(meta.seq_lens)), (o := torch.empty_like(q)), "
                  "scaling) or o",
}


@pytest.mark.slow
@pytest.mark.parametrize("route", list(SET07_ROUTES))
def test_set07_attention_reached_through_the_library_scores_0(tmp_path, route):
    """Before the fix: paged_attention 4/4 through the engine's ``torch_paged_attention`` or lesson 6's
    ``ref_paged_prefill_attention`` (the exercise told the learner to call the latter); the engine's
    ``paged_attention`` and the compiled CPU attention are hidden too (``tests/test_exercises_07_serving_engine.py``
    walks the library for every such route)."""
    answer = SET07_ATTENTION.replace("ROUTE", SET07_ROUTES[route])
    scores = grade_variant(tmp_path, "07_serving_engine", {"paged_attention": answer})
    assert scores["paged_attention"] == 0, scores


# Both pieces right on the step their end-to-end check tries first (so the check goes on to the engine), wrong
# inside the engine: prepare_inputs reads every request from position 0 (right while nothing is cached yet, as in
# the lesson's step), paged_attention always uses the last layer's cache (the layer of random_metadata(0)).
SET07_WRONG_IN_THE_ENGINE = {
    "prepare_inputs": ("start = scheduler_output.num_computed_tokens[rid]", "start = 0"),
    "paged_attention": ("meta.kv_caches[module.layer_idx]", "meta.kv_caches[-1]"),
}
# ...and a cell that hands the end-to-end run Hugging Face's tokens: the scenario that ran the engine in the
# learner's process, and the engine's generate itself, both replaced there by transformers' generate.
SET07_FORGED_GENERATE = '''

import types as _types

import pagedkv.engine as _engine
import pagedkv.grading.lessons.l07_serving_engine as _l07


def _hf_tokens(model, prompts, max_tokens):
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist() for p in prompts]


def _forged_generate(self, prompts, sampling_params=None, **kwargs):
    return [_types.SimpleNamespace(outputs=[_types.SimpleNamespace(token_ids=t)])
            for t in _hf_tokens(self.model, prompts, sampling_params.max_tokens)]


_engine.LLM.generate = _forged_generate
_l07.drive_end_to_end = lambda seed, prepare=None, attention=None: {
    "tokens": _hf_tokens(_l07.tiny_llama(seed), _l07.end_to_end_prompts(seed), 5)}
'''


@pytest.mark.slow
def test_set07_end_to_end_tokens_forged_in_the_learners_process_score_0(tmp_path):
    """The end-to-end checks used to run the engine in the sandbox and compare the tokens it returned: a cell that
    patches the engine's ``generate`` (or the scenario that called it) to return transformers' own greedy tokens
    passed both (2 points, with answers right only on the check's first step). The engine now runs in the grader's
    process, each call of the learner's function sent to the sandbox with its inputs as plain data."""
    import json

    from source_notebook import SourceNotebook

    solutions = SourceNotebook(ROOT / "grading" / "source" / "07_serving_engine.ipynb",
                               tolerate_cell_errors=True).solutions
    answers = {}
    for name, (old, new) in SET07_WRONG_IN_THE_ENGINE.items():
        assert old in solutions[name], f"the solution of {name} no longer contains {old!r}"
        answers[name] = solutions[name].replace(old, new)
    answers["prepare_inputs"] += SET07_FORGED_GENERATE
    grade_variant(tmp_path, "07_serving_engine", answers)
    cases = {c["name"]: c for e in json.loads((tmp_path / "r.json").read_text())["notebooks"][0]["exercises"]
             for c in e["cases"]}
    # the first step of each end-to-end check passes (so the engine runs), the engine's tokens do not
    assert cases["test_prepare_inputs_example"]["passed"], cases["test_prepare_inputs_example"]
    for case in ("test_prepare_inputs_end_to_end", "test_paged_attention_end_to_end"):
        assert not cases[case]["passed"], cases[case]
        assert "Hugging Face's generate gives" in cases[case]["message"], cases[case]


# --------------------------------------------------------------------------------------------------- set 03
SET03_MORE = {
    # The eviction is the library's _maybe_evict_cached_block, a private helper that the library's own
    # get_new_blocks and evict_blocks call.
    "EvictingBlockPool": EVICTING_POOL.format(
        evict='for block in blocks:\n            getattr(self, "_maybe_evict" + "_cached_block")(block)'),
    # Only the choice of blocks is the learner's: it is planted on the manager as a one-shot _blocks_written, so
    # the check's harness, whose super().allocate_slots is the library's (its copy loop is no exercise's
    # reference), would do the copy itself (fresh block, table, free, pending_copies).
    "copy_on_write": '''def copy_on_write(manager, request, num_new_tokens):
    bs = manager.block_size
    table = manager.req_to_blocks[request.request_id]
    first = request.num_computed_tokens // bs
    last = min(len(table), -(-(request.num_computed_tokens + num_new_tokens) // bs))
    shared = [i for i in range(first, last) if table[i].ref_cnt > 1]

    def once(*args):
        del manager._blocks_written
        return shared

    manager._blocks_written = once
''',
}


@pytest.mark.slow
def test_set03_copy_on_write_planted_on_the_checks_manager_scores_0(tmp_path):
    """copy_on_write planting ``manager._blocks_written`` (the check's manager would run the library's copy for it):
    the scenario's harness drops methods planted on the manager and the check fails the call (5/5 before; the
    variants that reach the library's copy by other ways: tests/test_exercises_03_prefix_caching.py)."""
    scores = grade_variant(tmp_path, "03_prefix_caching", {"copy_on_write": SET03_MORE["copy_on_write"]})
    assert scores["copy_on_write"] == 0, scores


@pytest.mark.slow
def test_set03_eviction_through_the_librarys_private_helper_scores_0(tmp_path):
    """Before the fix: eviction_on_reuse 1/5 with an eviction through ``BlockPool._maybe_evict_cached_block``,
    which the grader kept in every sandbox because a check composes the learner's pool with the library's
    ``get_new_blocks``, which calls it. Now the helper is hidden like the rest of the reference, and a case that
    composes the learner's class with library methods gets, with them, the private helpers they call
    (``worker.private_helpers``)."""
    scores = grade_variant(tmp_path, "03_prefix_caching", {"EvictingBlockPool": SET03_MORE["EvictingBlockPool"]})
    assert scores["eviction_on_reuse"] == 0, scores
