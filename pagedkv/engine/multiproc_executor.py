"""The tensor-parallel executor: one worker process per rank, started, driven and stopped by the engine.

The engine's process keeps the scheduler and the sampler; it starts ``tp`` worker processes, on Linux each forked
from multiprocessing's *fork server* (a fresh interpreter started once per engine process, which has imported torch,
transformers and the worker's code: a worker starts in a fraction of a second instead of importing them again;
elsewhere a fresh interpreter each, *spawn*), never a fork of the engine's own process, which may hold CUDA or
threads. They join one ``torch.distributed`` group (gloo on a CPU, NCCL on GPUs) through a ``TCPStore`` the engine
opened on the loopback at a free port.
Each step the engine broadcasts the scheduler output, pickled once, to every rank; every rank runs the same
forward pass on its shard (the ranks meet in the model's all-reduces) and rank 0, the output rank, sends back the
gathered logits. The others send an empty acknowledgement, so a rank that fails is seen at once.

Workers never outlive the engine, whatever happens to it:

- ``shutdown()`` (also at garbage collection and at interpreter exit, through ``weakref.finalize``) asks each
  worker to stop, then terminates and finally kills any that do not;
- each worker watches a *death pipe* whose only writer is the engine: when the engine's process dies in any way
  (an exception, ``SIGKILL``, a killed notebook kernel) the kernel closes it and the worker exits;
- a worker that raises or dies makes the engine stop every worker and raise ``RuntimeError`` with its traceback
  (another rank may be blocked in a collective, waiting for it);
- workers ignore ``SIGINT``: a Ctrl-C in a terminal or Jupyter's interrupt (which signals the kernel's whole
  process group) interrupts the engine only. The engine discards the interrupted step's late replies by
  sequence number, and defers a ``SIGINT`` that arrives while it is broadcasting (a step sent to only some
  ranks would leave the others waiting in a collective) or reading a reply (half a message read would leave
  the pipe out of step).

Mirrors vLLM 0.26's ``MultiprocExecutor`` (``vllm/v1/executor/multiproc_executor.py``: ``_init_executor``,
``collective_rpc``, ``execute_model``, ``shutdown``, ``WorkerProc.worker_main``, ``monitor_death_pipe``,
``start_worker_monitor``). vLLM broadcasts through a shared-memory ring buffer (``MessageQueue``); the lab uses
one pipe per worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
import types
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from pagedkv.sched_output import SchedulerOutput

#: Seconds a worker gets to leave after being asked, then after SIGTERM, before it is killed.
SHUTDOWN_TIMEOUT_S = 5.0
#: How workers start: forked from multiprocessing's fork server on Linux; elsewhere (macOS, where a fork of a process
#: that has loaded Apple's frameworks may crash) a fresh interpreter each (*spawn*).
START_METHOD = "forkserver" if sys.platform.startswith("linux") else "spawn"
#: What the fork server imports once, before it forks any worker: the worker's code, torch, and transformers'
#: model machinery (about 5 CPU-seconds a worker spent importing them before each start). Never ``__main__``.
FORKSERVER_PRELOAD = ["pagedkv.engine.multiproc_executor", "pagedkv.engine.worker", "transformers.modeling_utils"]
#: Seconds the ranks wait for one another at start-up and in any collective before gloo raises.
COLLECTIVE_TIMEOUT_S = 600.0


class WorkerError(RuntimeError):
    """A worker raised or died; the executor has stopped every worker."""


def _loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS) for gloo, which otherwise binds to the
    address the host name resolves to (often unreachable in a sandbox)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in names if n.startswith("lo")), None)


def _watch_death_pipe(death_pipe: mpc.Connection) -> None:
    """Block until the engine's end of the death pipe closes (the engine is gone), then exit at once."""
    try:
        death_pipe.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def worker_main(rank: int, world_size: int, port: int, device: str, conn: mpc.Connection,
                death_pipe: mpc.Connection) -> None:
    """A worker process: join the group, then serve ``(seq, method, args)`` requests until ``shutdown`` or until
    the engine goes away. Replies ``(seq, "ok", result)`` or ``(seq, "error", traceback)``. Mirrors
    ``WorkerProc.worker_main`` and ``worker_busy_loop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine handles Ctrl-C; it tells us when to stop
    threading.Thread(target=_watch_death_pipe, args=(death_pipe,), daemon=True, name="death-pipe").start()
    iface = _loopback_interface()
    if iface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", iface)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    from pagedkv.distributed.parallel_state import destroy_distributed_environment, init_distributed_environment
    from pagedkv.engine.worker import Worker

    try:
        if device == "cuda":
            torch.cuda.set_device(rank)  # before NCCL's communicator is created
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=_timedelta(60))
        init_distributed_environment(rank, world_size, store, "nccl" if device == "cuda" else "gloo",
                                     COLLECTIVE_TIMEOUT_S)
        worker = Worker(rank, world_size, f"cuda:{rank}" if device == "cuda" else "cpu")
        conn.send((0, "ok", os.getpid()))
    except BaseException:
        conn.send((0, "error", traceback.format_exc()))
        os._exit(1)
    while True:
        try:
            seq, method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if method == "shutdown":
            conn.send((seq, "ok", None))
            break
        try:
            conn.send((seq, "ok", getattr(worker, method)(*args)))
        except Exception:
            conn.send((seq, "error", f"rank {rank}: {traceback.format_exc()}"))
    destroy_distributed_environment()
    conn.close()
    os._exit(0)


def _timedelta(seconds: float):
    import datetime

    return datetime.timedelta(seconds=seconds)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """``SIGINT`` ignored while worker processes start, so they inherit the disposition from their first
    instruction (Python keeps an inherited ``SIG_IGN``). Main thread only (elsewhere: a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Hide the caller's ``__main__`` while workers start: the fork server (as *spawn*) would otherwise re-run the
    caller's script in each worker (to find functions defined there), so a script without an
    ``if __name__ == "__main__":`` guard would start engines recursively. The workers need nothing from it:
    their entry point is this module's."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """A ``SIGINT`` arriving inside the block is held and raised (``KeyboardInterrupt``) when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if caught:
            if callable(old):
                old(signal.SIGINT, None)
            elif old != signal.SIG_IGN:
                raise KeyboardInterrupt


def _stop_workers(procs: list, conns: list, death_writers: list, store_box: list) -> None:
    """Stop every worker: ask, wait, SIGTERM, wait, SIGKILL; close the pipes and the store. Idempotent; safe at
    interpreter exit. Mirrors ``MultiprocExecutor.shutdown`` and ``_ensure_worker_termination``."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send_bytes(pickle.dumps((-1, "shutdown", ())))
    for step in ("ask", "terminate", "kill"):
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        if step == "terminate":
            for p in alive:
                p.terminate()
        elif step == "kill":
            for p in alive:
                p.kill()
        mpc.wait([p.sentinel for p in alive], timeout=SHUTDOWN_TIMEOUT_S)
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(timeout=SHUTDOWN_TIMEOUT_S)
    for c in (*conns, *death_writers):
        with contextlib.suppress(OSError):
            c.close()
    store_box.clear()


class _StepFuture(Future):
    """A step sent to every rank; ``result()`` gathers the replies (rank 0's output), once."""

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        super().__init__()
        self._executor, self._seq = executor, seq

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self.set_result(self._executor._gather(self._seq)[0])
            except BaseException as exc:
                self.set_exception(exc)
        return super().result(timeout)


class MultiprocExecutor:
    """``tensor_parallel_size`` worker processes, one per rank, driven by the engine.

    ``device``: ``"cpu"`` (gloo; ``tp`` processes on any machine) or ``"cuda"`` (NCCL; rank ``r`` on GPU ``r``,
    ``tp`` GPUs needed). The model is sent to every rank, which keeps its shard (``Worker.load_model``).
    Use :meth:`shutdown` (or ``with``) to stop the workers; they also stop when this object is collected and
    when the engine's process exits or dies."""

    #: Steps that may be in flight at once (``EngineCore.step_with_batch_queue``): 2 under async scheduling.
    max_concurrent_batches = 1

    def __init__(self, model: torch.nn.Module, tensor_parallel_size: int, device: str = "cpu") -> None:
        from pagedkv.engine.worker import serialize_model

        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda" and torch.cuda.device_count() < tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} GPUs; "
                             f"this machine has {torch.cuda.device_count()}")
        self.world_size, self.device = tensor_parallel_size, device
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[mpc.Connection] = []
        self._death_writers: list[mpc.Connection] = []
        # the store's server runs in this process, on a port the OS picked: parallel engines never collide
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                           timeout=_timedelta(60))
        self._store_box = [store]
        self._seq = 0
        self._awaited: set[int] = set()  # requests sent whose replies are still wanted
        self._stash: dict[int, dict[int, Any]] = {}  # replies that arrived while another request was gathered
        self.dead: str | None = None
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._death_writers,
                                           self._store_box)
        ctx = mp.get_context(START_METHOD)
        if START_METHOD == "forkserver":
            ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
        try:
            with _sigint_ignored(), _main_module_hidden():
                for rank in range(tensor_parallel_size):
                    parent_conn, child_conn = ctx.Pipe()
                    death_reader, death_writer = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=worker_main, name=f"pagedkv-tp-rank{rank}", daemon=True,
                                       args=(rank, tensor_parallel_size, store.port, device, child_conn,
                                             death_reader))
                    proc.start()
                    child_conn.close()
                    death_reader.close()  # ours is the only writer left: its close (or our death) is the signal
                    self.procs.append(proc)
                    self.conns.append(parent_conn)
                    self._death_writers.append(death_writer)
            self._awaited.add(0)
            self.pids = self._gather(0)
            self.shard_info = self.collective_rpc("load_model", (serialize_model(model),))
        except BaseException:
            self.shutdown()
            raise

    # ----------------------------------------------------------------------------------------------------------
    def _gather(self, seq: int) -> list[Any]:
        """Every rank's reply to request ``seq``, in rank order. A reply to another request still awaited (a step
        in flight) is kept for it; one to an abandoned request (interrupted by Ctrl-C) is dropped. An error reply
        or a dead worker stops all workers and raises :class:`WorkerError`. Waiting is interruptible; reading a
        reply is not: a ``SIGINT`` that arrives while a reply is read and filed is raised once it is filed (the
        pipe would otherwise be left in the middle of a message, and the next read would take the rest of it
        for a new one)."""
        results: dict[int, Any] = self._stash.pop(seq, {})
        pending = set(range(self.world_size)) - set(results)
        try:
            while pending:
                waitables = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
                for obj in mpc.wait(waitables):
                    rank = next((r for r in pending if obj is self.conns[r]), None)
                    if rank is None:  # a sentinel: that process has ended
                        rank = next(r for r in pending if obj == self.procs[r].sentinel)
                        if self.conns[rank].poll():
                            continue  # read its last reply first
                        self._fail(self._died(rank))
                    with _sigint_deferred():
                        failure = self._file_reply(rank, seq, results, pending)
                    if failure is not None:
                        # a rank that died explains a survivor's error (its collective lost the peer): name it
                        dead = [r for r in range(self.world_size) if r != rank and not self.procs[r].is_alive()]
                        self._fail(f"{self._died(dead[0])}; then {failure}" if dead else failure)
        finally:
            self._awaited.discard(seq)
        return [results[r] for r in range(self.world_size)]

    def _died(self, rank: int) -> str:
        return f"worker rank {rank} (pid {self.procs[rank].pid}) died (exit code {self.procs[rank].exitcode})"

    def _file_reply(self, rank: int, seq: int, results: dict[int, Any], pending: set[int]) -> str | None:
        """Read one reply of ``rank`` and file it: into ``results`` (a reply to ``seq``), the stash (to another
        request still awaited) or nowhere (an abandoned one). Returns why the workers must stop, or ``None``."""
        try:
            got_seq, status, payload = self.conns[rank].recv()
        except (EOFError, OSError):
            return f"worker rank {rank} (pid {self.procs[rank].pid}) closed its pipe"
        if status != "ok":
            return f"worker rank {rank} raised:\n{payload}"
        if got_seq == seq:
            results[rank] = payload
            pending.discard(rank)
        elif got_seq in self._awaited:
            self._stash.setdefault(got_seq, {})[rank] = payload
        return None

    def _broadcast(self, method: str, args: tuple = (), per_rank_args: Sequence[tuple] | None = None) -> int:
        """Send ``Worker.<method>`` to every rank (``per_rank_args[rank]`` to each, when given); returns the
        request's sequence number. Pickled once; ``SIGINT`` deferred until every rank has it."""
        if self.dead is not None:
            raise WorkerError(f"the tensor-parallel workers are stopped ({self.dead}); create a new LLM")
        self._seq += 1
        seq = self._seq
        if per_rank_args is None:
            payloads = [pickle.dumps((seq, method, args), protocol=pickle.HIGHEST_PROTOCOL)] * self.world_size
        else:
            if len(per_rank_args) != self.world_size:
                raise ValueError(f"per_rank_args needs {self.world_size} tuples, got {len(per_rank_args)}")
            payloads = [pickle.dumps((seq, method, a), protocol=pickle.HIGHEST_PROTOCOL) for a in per_rank_args]
        self._awaited.add(seq)
        try:
            with _sigint_deferred():
                for conn, payload in zip(self.conns, payloads, strict=True):
                    conn.send_bytes(payload)
        except KeyboardInterrupt:  # every rank has the request; no one will gather it, so its replies are dropped
            self._awaited.discard(seq)
            raise
        except (OSError, ValueError) as exc:
            self._fail(f"could not send {method!r} to the workers ({exc})")
        return seq

    def _fail(self, why: str) -> None:
        self.dead = why
        self.shutdown()
        raise WorkerError(f"{why}\nEvery tensor-parallel worker has been stopped; create a new LLM.")

    def collective_rpc(self, method: str, args: tuple = (), per_rank_args: Sequence[tuple] | None = None) -> list:
        """Call ``Worker.<method>(*args)`` on every rank (or ``per_rank_args[rank]`` on each) and return the
        results in rank order. Mirrors ``MultiprocExecutor.collective_rpc``."""
        return self._gather(self._broadcast(method, args, per_rank_args))

    def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        """One step on every rank; rank 0's output (every rank computed the same one). ``non_block``: return at
        once a future whose ``result()`` waits for the ranks' replies (two steps may be in flight). Mirrors
        ``MultiprocExecutor.execute_model``."""
        seq = self._broadcast("execute_model", (scheduler_output,))
        if non_block:
            return _StepFuture(self, seq)
        return self._gather(seq)[0]

    def determine_num_blocks(self, block_size: int, kv_cache_memory_bytes: int | Sequence[int] | None = None,
                             gpu_memory_utilization: float = 0.92) -> int:
        """The pool's block count: each rank's own count (``Worker.determine_num_blocks``; ``kv_cache_memory_bytes``
        is per rank, one figure for all or one per rank), then the minimum, since one scheduler hands out block
        ids that must exist on every rank (``get_kv_cache_configs``, ``vllm/v1/core/kv_cache_utils.py``). The
        per-rank counts stay in ``num_blocks_per_rank``."""
        from pagedkv.sizing.parallel import unify_num_blocks

        budget = kv_cache_memory_bytes
        if budget is None or isinstance(budget, int):
            per_rank = [(block_size, budget, gpu_memory_utilization)] * self.world_size
        else:
            budget = list(budget)
            if len(budget) != self.world_size or not all(isinstance(b, int) and b >= 0 for b in budget):
                raise ValueError(f"kv_cache_memory_bytes: one int >= 0 or {self.world_size} of them, got {budget!r}")
            per_rank = [(block_size, b, gpu_memory_utilization) for b in budget]
        self.num_blocks_per_rank = self.collective_rpc("determine_num_blocks", per_rank_args=per_rank)
        return unify_num_blocks(self.num_blocks_per_rank)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int, max_model_len: int,
                         backend: str, max_num_seqs: int, seed: int = 0) -> list[tuple[int, ...]]:
        """Every rank allocates ``num_gpu_blocks`` blocks of its KV heads per layer; returns each rank's key-cache
        shape ``(num_blocks, block_size, kv_heads_per_rank, head_dim)``, checked to hold the same block count.
        Mirrors ``MultiprocExecutor.initialize_from_config``."""
        shapes = self.collective_rpc("initialize_cache", (num_gpu_blocks, num_cpu_blocks, block_size, max_model_len,
                                                          backend, max_num_seqs, seed))
        if len({s[0] for s in shapes}) != 1:
            self._fail(f"the ranks allocated different block counts: {shapes}")
        self.kv_cache_shapes = shapes
        self._kv_cache_bytes = self.collective_rpc("kv_cache_bytes")
        return shapes

    def kv_cache_bytes(self) -> int:
        """Bytes of one rank's KV cache (all layers, K and V): what one GPU gives the cache. Every rank holds
        as much (the same blocks, its share of the heads)."""
        return int(self._kv_cache_bytes[0])

    def shutdown(self) -> None:
        """Stop every worker (idempotent). Mirrors ``MultiprocExecutor.shutdown``."""
        if self.dead is None:
            self.dead = "shut down"
        self._finalizer()

    def is_alive(self) -> bool:
        return self.dead is None and all(p.is_alive() for p in self.procs)

    def __enter__(self) -> MultiprocExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "alive" if self.is_alive() else f"stopped: {self.dead}"
        return f"MultiprocExecutor(tp={self.world_size}, {self.device}, pids={[p.pid for p in self.procs]}, {state})"


