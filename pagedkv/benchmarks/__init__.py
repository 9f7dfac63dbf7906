"""The lab's benchmarks: each module prints a table when run with ``python -m``.

- ``pagedkv.benchmarks.block_pool``: allocate+free and cache-hit removal on the free-block queue against pool
  size (1e3 to 1e6 blocks), the linked list vs a naive list vs ``collections.deque`` (lesson 2).
- ``pagedkv.benchmarks.prefix_cache``: what a prefix-cache lookup and block hashing cost (lesson 3).
- ``pagedkv.benchmarks.engine``: the lesson 7 engine against transformers' ``generate``, a static batch and
  ``generate_batch`` (lesson 7).
"""
