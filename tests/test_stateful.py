"""Hypothesis state machine over random admit, decode, fork, free and reset sequences.

After every step: the pool's invariants hold (each block free with ref_cnt 0, or held with ref_cnt equal to
its number of holders; free + held = num_blocks - 1; the cache map matches the blocks' hashes), and every
live request reads its own tokens back from a shadow KV cache (so no cache hit, fork or copy-on-write ever
hands a request someone else's KV). The same operations run on a manager with caching off: with caching on
or off, every request sees exactly its own tokens (caching only changes how many blocks that takes, so the
two systems may admit or grow different requests when the pool is tight).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from pkv_testing import assert_reads_own_tokens, check_invariants, step

from pagedkv import KVCacheManager, Request
from pagedkv.shadow import ShadowKVCache

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5]]


class ManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks, block_size):
        self.bs = block_size
        self.systems = {
            on: (KVCacheManager(num_blocks, block_size, enable_caching=on), ShadowKVCache(num_blocks, block_size))
            for on in (True, False)
        }
        self.live: dict[bool, dict[str, Request]] = {True: {}, False: {}}
        self.n = 0

    def _new_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=5))
    def admit(self, prefix, tail):
        rid = self._new_id()
        for on, (m, shadow) in self.systems.items():
            req = Request(rid, prefix + tail, max_tokens=64)
            before = m.snapshot()
            hits, n = m.get_computed_blocks(req)
            if step(m, shadow, req, req.num_tokens - n, hits):
                self.live[on][rid] = req
            else:
                assert m.snapshot() == before, "a failed allocation changed the pool"

    @precondition(lambda self: self.live[True] or self.live[False])
    @rule(data=st.data(), token=st.integers(0, 3))
    def decode(self, data, token):
        rid = data.draw(st.sampled_from(sorted(set(self.live[True]) | set(self.live[False]))))
        for on, (m, shadow) in self.systems.items():
            req = self.live[on].get(rid)
            if req is None:
                continue
            req.append_output_token_ids(token)
            before = m.snapshot()
            if not step(m, shadow, req, 1):
                assert m.snapshot() == before
                req.output_token_ids.pop()
                req.all_token_ids.pop()

    @precondition(lambda self: self.live[True] or self.live[False])
    @rule(data=st.data())
    def fork(self, data):
        rid = data.draw(st.sampled_from(sorted(set(self.live[True]) | set(self.live[False]))))
        cid = self._new_id()
        for on, (m, _) in self.systems.items():
            parent = self.live[on].get(rid)
            if parent is None:
                continue
            child = Request(cid, parent.all_token_ids[: parent.num_computed_tokens], max_tokens=64)
            m.fork(parent, child)
            self.live[on][cid] = child

    @precondition(lambda self: self.live[True] or self.live[False])
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(set(self.live[True]) | set(self.live[False]))))
        for on, (m, _) in self.systems.items():
            req = self.live[on].pop(rid, None)
            if req is not None:
                m.free(req)

    @rule()
    def reset(self):
        for on, (m, _) in self.systems.items():
            assert m.reset_prefix_cache() == (not self.live[on])

    @invariant()
    def pool_is_consistent(self):
        for m, _ in self.systems.values():
            check_invariants(m)

    @invariant()
    def every_request_reads_its_own_tokens(self):
        for on, (m, shadow) in self.systems.items():
            for req in self.live[on].values():
                assert_reads_own_tokens(m, shadow, req)



@pytest.mark.slow
class TestManagerMachine(ManagerMachine.TestCase):
    """300 random programs of up to 40 steps (the full suite)."""

    settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class TestManagerMachineFast(ManagerMachine.TestCase):
    """The same machine with 50 programs, for the fast tier."""

    settings = settings(max_examples=50, stateful_step_count=40, deadline=None)
