"""Exercise set 07 (the engine): its checks pass the solution, fail the stub, and fail plausible wrong answers
in a public test with a message that names the mistake.

The test cells of ``grading/source/07_serving_engine.ipynb`` run here in-process (``tests/source_notebook.py``);
``tests/test_grading.py`` grades the built notebooks end to end through ``pagedkv grade``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from source_notebook import SourceNotebook, stub
from test_engine import one_thread  # noqa: F401 (an autouse fixture: one torch thread)

SOURCE = Path(__file__).resolve().parents[1] / "grading" / "source" / "07_serving_engine.ipynb"
QUESTIONS = ["prepare_inputs", "paged_attention"]
NB = SourceNotebook(SOURCE, tolerate_cell_errors=True)
ITEMS, SOLUTIONS = NB.items, NB.solutions


def test_the_source_has_every_question_with_public_and_hidden_tests() -> None:
    assert list(SOLUTIONS) == QUESTIONS
    for q in QUESTIONS:
        tests = [hidden for kind, qq, _, hidden in ITEMS if kind == "test" and qq == q]
        assert False in tests and True in tests, f"{q} needs public and hidden tests"


@pytest.mark.slow  # 3-7 s alone: out of the fast tier (./lab test --fast)
def test_solution_passes_and_stub_fails_every_test() -> None:
    results = NB.grade({})
    assert len(results) == 8 and all(ok for *_, ok, _ in results), [(q, m) for q, _, ok, m in results if not ok]
    results = NB.grade({q: stub(src) for q, src in SOLUTIONS.items()})
    assert not [q for q, _, ok, _ in results if ok] and all(msg for *_, msg in results)


WRITE = ("    key_cache.view(-1, hkv, d)[meta.slot_mapping] = k\n"
         "    value_cache.view(-1, hkv, d)[meta.slot_mapping] = v\n")
ATTEND = """    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        lo, hi = starts[b], starts[b + 1]
        if hi > lo:
            k_b, v_b = gather_kv(key_cache, value_cache, meta.block_tables[b], seq_len)  # [seq_len, Hkv, D]
            out[lo:hi] = attention(q[lo:hi], k_b, v_b, scale, causal_offset=seq_len - (hi - lo))
"""
# attention written by hand, one request at a time (HEADS: which KV head each query head reads)
OWN_ATTENTION = """    hq, bs = q.shape[1], key_cache.shape[1]
    out = torch.empty_like(q)
    for b, seq_len in enumerate(meta.seq_lens.tolist()):
        lo, hi = int(meta.query_start_loc[b]), int(meta.query_start_loc[b + 1])
        pos = torch.arange(seq_len)
        slots = meta.block_tables[b][pos // bs].long() * bs + pos % bs
        kk = key_cache.view(-1, hkv, d)[slots][:, HEADS]
        vv = value_cache.view(-1, hkv, d)[slots][:, HEADS]
        scores = torch.einsum("thd,lhd->htl", q[lo:hi], kk) * scaling
        qpos = torch.arange(lo, hi) - lo + seq_len - (hi - lo)
        scores = scores.masked_fill(pos[None, :] > qpos[:, None], float("-inf"))
        out[lo:hi] = torch.einsum("htl,lhd->thd", scores.softmax(-1), vv)
"""

# (id, question, text in the solution, replaced by, a phrase the learner must see in the first public failure)
WRONG = [
    ("positions_from_zero", "prepare_inputs", "out.positions.append(p)", "out.positions.append(p - start)",
     "positions"),
    ("slot_without_table", "prepare_inputs", "table[p // block_size] * block_size + p % block_size", "p",
     "slot_mapping"),
    ("seq_len_is_chunk", "prepare_inputs", "out.seq_lens.append(start + n)", "out.seq_lens.append(n)", "seq_lens"),
    ("samples_partial_prefills", "prepare_inputs", "if rid not in partial:", "if True:", "sample_req_ids"),
    ("logits_row_off_by_one", "prepare_inputs", "out.query_start_loc[-1] - 1)", "out.query_start_loc[-1])",
     "logits_indices"),
    ("sorts_the_requests", "prepare_inputs", "req_ids = list(scheduler_output.num_scheduled_tokens)",
     "req_ids = sorted(scheduler_output.num_scheduled_tokens)", "scheduling order"),
    ("never_writes", "paged_attention", "    key_cache.view(-1, hkv, d)[meta.slot_mapping] = k\n"
     "    value_cache.view(-1, hkv, d)[meta.slot_mapping] = v\n", "", "keys were not written"),
    ("attends_before_writing", "paged_attention", WRITE + ATTEND, ATTEND + WRITE,
     "BEFORE this step's keys and values were written"),
    ("keys_into_the_value_cache", "paged_attention", "value_cache.view(-1, hkv, d)[meta.slot_mapping] = v",
     "value_cache.view(-1, hkv, d)[meta.slot_mapping] = k", "holds the token's key, not its value"),
    ("reshape_not_transpose", "paged_attention", "k = key[0].transpose(0, 1)",
     "k = key[0].reshape(key.shape[2], key.shape[1], key.shape[3])", "not with reshape or view"),
    ("no_scaling", "paged_attention", "v_b, scale, causal", "v_b, 1.0, causal",
     "softmax scale 1"),
    ("gqa_heads_modulo", "paged_attention", ATTEND, OWN_ATTENTION.replace("HEADS", "torch.arange(hq) % hkv"),
     "h // (Hq // Hkv)"),
    ("gqa_ignored", "paged_attention", ATTEND, OWN_ATTENTION.replace("[:, HEADS]", ""), "repeat_interleave"),
    ("no_causal_mask", "paged_attention", ATTEND, OWN_ATTENTION.replace("HEADS", "torch.arange(hq) // (hq // hkv)")
     .replace('        scores = scores.masked_fill(pos[None, :] > qpos[:, None], float("-inf"))\n', ""),
     "tokens after them in the same chunk"),
    ("mask_not_offset", "paged_attention", ATTEND, OWN_ATTENTION.replace("HEADS", "torch.arange(hq) // (hq // hkv)")
     .replace("qpos = torch.arange(lo, hi) - lo + seq_len - (hi - lo)", "qpos = torch.arange(hi - lo)"),
     "not offset by the cached prefix"),
    ("wrong_layer", "paged_attention", "meta.kv_caches[module.layer_idx]", "meta.kv_caches[0]", "layer"),
    ("forgets_transpose_back", "paged_attention", "return out.to(query.dtype)[None], None",
     "return out.to(query.dtype).transpose(0, 1)[None], None", "[1, T, Hq, D]"),
]


def test_attention_written_by_hand_passes() -> None:
    """The hand-written attention the wrong answers below start from is right as it stands."""
    heads = "torch.arange(hq) // (hq // hkv)"
    own = SOLUTIONS["paged_attention"].replace(ATTEND, OWN_ATTENTION.replace("HEADS", heads))
    assert own != SOLUTIONS["paged_attention"]
    results = NB.grade({"paged_attention": own}, only={"paged_attention"})
    assert results and all(ok for *_, ok, _ in results), [m for *_, ok, m in results if not ok]


@pytest.mark.parametrize("wid, question, old, new, phrase", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_answer_fails_a_public_test_with_a_clear_message(wid, question, old, new, phrase) -> None:
    assert old in SOLUTIONS[question], f"{wid}: the solution no longer contains the text to break"
    results = NB.grade({question: SOLUTIONS[question].replace(old, new)}, only={question}, public_only=True)
    failures = [msg for q, _, ok, msg in results if not ok]
    assert failures, f"{wid}: no public test of {question} catches this mistake"
    assert phrase in failures[0], f"{wid}: the first failure does not say {phrase!r}: {failures[0]}"


def test_a_call_that_rewrites_the_metadata_cannot_reach_the_reference() -> None:
    """issue 19: the learner's call gets a deep copy of the step's metadata, so ``slot_mapping.fill_(-1)`` there
    changes neither the reference's metadata nor the check's (it used to make both write slot -1 and agree)."""
    from pagedkv.engine.attention import paged_attention_forward
    from pagedkv.grading.lessons import l07_serving_engine as l07

    def corrupting(module, query, key, value, attention_mask, scaling=None, pagedkv_metadata=None, **kwargs):
        pagedkv_metadata.slot_mapping.fill_(-1)  # every token's k/v to the last slot, for both sides if shared
        return paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                       pagedkv_metadata=pagedkv_metadata)

    with pytest.raises(AssertionError, match="differs from the reference"):
        l07.check_attention_random_steps(corrupting)


# ------------------------------------------------------------------------------------------------- end to end
def _wreck(meta, *tensors):
    """What a careless call could do to everything it was given, once it has its answer."""
    meta.slot_mapping.fill_(-1)
    meta.seq_lens.zero_()
    meta.query_start_loc.zero_()
    meta.block_tables.zero_()
    for t in tensors:
        t.zero_()


def test_end_to_end_runs_the_engine_here_with_one_scenario_per_call(monkeypatch) -> None:
    """The end-to-end checks run the engine in the check's process (under ``pagedkv grade`` nothing the learner's
    process returns could stand in for its tokens): each call it makes of the learner's function is one scenario
    (``drive_prepare_call``, ``drive_attention_call``) sent plain data, and the engine goes on with copies of the
    plain data that came back, so a call that wrecks the inputs it was given changes nothing in the engine."""
    from pagedkv.engine.attention import paged_attention_forward
    from pagedkv.engine.model_runner import prepare_inputs
    from pagedkv.grading import checks
    from pagedkv.grading.lessons import l07_serving_engine as l07
    from pagedkv.grading.plain import decode, encode

    scenarios = []

    def recording(scenario, *args, **kwargs):
        encode(list(args[1:]))  # plain data only, besides the learner's function
        record = checks.drive(scenario, *args, **kwargs)
        assert isinstance(decode(encode(record)), (dict, list))  # plain data back
        scenarios.append(scenario.__name__)
        return record

    monkeypatch.setattr(l07, "drive", recording)

    def attention(module, query, key, value, attention_mask, scaling=None, pagedkv_metadata=None, **kwargs):
        out = paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      pagedkv_metadata=pagedkv_metadata)
        _wreck(pagedkv_metadata, query, key, value)
        return out

    l07.check_attention_end_to_end(attention)
    assert scenarios[0] == "drive_attention" and set(scenarios[1:]) == {"drive_attention_call"}, scenarios
    assert len(scenarios) > 20, len(scenarios)  # two layers a step, a dozen steps and more

    def prepare(scheduler_output, token_ids, block_size):
        got = prepare_inputs(scheduler_output, token_ids, block_size)
        scheduler_output.num_scheduled_tokens.clear()
        scheduler_output.block_tables.clear()
        token_ids.clear()
        return got

    scenarios.clear()
    l07.check_prepare_inputs_end_to_end(prepare)
    assert scenarios[0] == "drive_prepare_inputs" and set(scenarios[1:]) == {"drive_prepare_call"}, scenarios
    assert len(scenarios) > 10, len(scenarios)


def test_a_call_that_fails_only_inside_the_engine_says_so() -> None:
    """A function right on the check's first step but not on what the engine gives it: its raise (with its line) or
    its unusable result is the end-to-end failure, as the engine met it."""
    from pagedkv.engine.attention import paged_attention_forward
    from pagedkv.engine.model_runner import prepare_inputs
    from pagedkv.grading.lessons import l07_serving_engine as l07

    def raises(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if query.shape[1] == 4:  # the engine's model: Hq 4 (the first step's: 2)
            raise ValueError("only in the engine")
        return paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    with pytest.raises(AssertionError, match=r"^generate\(.*\) raised ValueError: only in the engine "
                                             r"\(in raises, line \d+: raise ValueError"):
        l07.check_attention_end_to_end(raises)

    def untransposed(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if query.shape[1] == 4:
            return query, None
        return paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    with pytest.raises(AssertionError, match=r"failed: the output of paged_attention should be a tensor of shape "
                                             r"\(1, \d+, 4, 16\) = \[1, T, Hq, D\], got \(1, 4, \d+, 16\)"):
        l07.check_attention_end_to_end(untransposed)

    def none_once_cached(scheduler_output, token_ids, block_size):
        if any(scheduler_output.num_computed_tokens.values()):  # the lesson's step has nothing cached yet
            return None
        return prepare_inputs(scheduler_output, token_ids, block_size)

    with pytest.raises(AssertionError, match=r"failed: prepare_inputs returned None: is it still the stub"):
        l07.check_prepare_inputs_end_to_end(none_once_cached)

    def wild_once_cached(scheduler_output, token_ids, block_size):
        got = prepare_inputs(scheduler_output, token_ids, block_size)
        if any(scheduler_output.num_computed_tokens.values()):
            got.query_start_loc[-1] += 1000  # rows past the batch: what the engine's kernels must never read
        return got

    with pytest.raises(AssertionError, match=r"failed: prepare_inputs returned inputs the engine cannot run for the "
                                             r"step .*: query_start_loc\[\d+\] is \d+, outside 0 \.\. \d+"):
        l07.check_prepare_inputs_end_to_end(wild_once_cached)


def test_only_inputs_the_engine_can_run_reach_it() -> None:
    """The engine runs the learner's ``ModelInputs`` in the grader's process, and its compiled kernels index its pool
    with them: every number must be one the step allows (the library's answer always is)."""
    from pagedkv.engine.model_runner import prepare_inputs
    from pagedkv.grading.lessons import l07_serving_engine as l07

    for seed in range(5):
        for so, token_ids, bs in l07.random_steps(seed):
            assert l07.unrunnable_inputs(prepare_inputs(so, token_ids, bs), so, token_ids, bs) is None
    so, token_ids, bs = l07.example_step()
    for field, change, phrase in [
        ("req_ids", lambda v: v + v[:1], "each scheduled request once"),
        ("sample_req_ids", lambda v: ["Z"], "some of req_ids"),
        ("seq_lens", lambda v: v[:-1], "seq_lens has"),
        ("block_tables", lambda v: [[t[0] + 1000] + t[1:] for t in v], "block_tables[0][0] is"),
        ("block_tables", lambda v: [t[:1] for t in v], "its table covers its seq_len"),
        ("slot_mapping", lambda v: [-2] + v[1:], "slot_mapping[0] is -2"),
        ("slot_mapping", lambda v: [0] + v[1:], "names a block that the step's tables do not hold"),  # block 0
        ("input_ids", lambda v: [10**6] + v[1:], "input_ids[0] is 1000000"),
        ("query_start_loc", lambda v: [0, v[2], v[1]] + v[3:], "increasing"),
        ("logits_indices", lambda v: [True] + v[1:], "logits_indices[0] is True"),
    ]:
        inputs = prepare_inputs(so, token_ids, bs)
        setattr(inputs, field, change(getattr(inputs, field)))
        why = l07.unrunnable_inputs(inputs, so, token_ids, bs)
        assert why is not None and phrase in why, (field, phrase, why)
