"""The process group in use: its handle (DistContext) and teardown, the hang watch's guard, the
control channel, and the collectives on small values (objects, votes, sums, broadcasts, bytes).

group.py joins the group and returns the DistContext. Only this module and its two siblings call
torch.distributed's collectives: gradsync.py (the gradients: DDP's comm hooks, SyncBatchNorm's
sum) and modelsync.py (a model's whole state: broadcasts, DCP, gathers); the trainer, the
checkpoint state, the stop vote and selftest call the helpers; tests/unit/test_layout.py checks
it. With one process there is no group and the helpers on the default group become no-ops, so
the trainer has a single code path.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
# Imported with this module, before any group exists, though gradsync.py is its user: imported
# later (first at job.wrap, once a group stood), a Python comm hook's last callback outlived
# close() under torchrun, its gloo thread still running into the interpreter's finalization
# (tests/ranks/test_api.py::test_the_groups_threads_end_before_the_interpreter[torchrun] fails
# without this line; measured, torch 2.14.1).
import torch.distributed.nn.functional  # noqa: F401

from ddpjob.errors import DDPJobError
from ddpjob.node import hang
from ddpjob.node.cluster import ClusterEnv

# This process's hang watch (node/hang.py), while it is one rank of a group of several.
_watch: hang.Watch | None = None
# True once a failed rank left its process group standing (DistContext.destroy(None)): the
# process then ends through end_if_left_standing (cli.console; NodeTask under submitit; a
# script run alone: ownerror.Uncaught._at_exit).
left_standing = False


def end_if_left_standing(code: int) -> None:
    """Where this rank failed and left its process group standing, end the process now with
    `code`, its output flushed, skipping the interpreter's teardown; else return. Why: with the
    group standing (the failed rank's peers may still be inside a collective with it) that
    teardown sometimes aborts in torch's C++ destructors ("terminate called without an active
    exception"): SIGABRT and a core instead of exit 1, in about one of six 2-rank gloo
    failures. Everything of ddpjob's is closed by then (Job.close)."""
    if not left_standing:
        return
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """End the process with `code` at once, its output flushed, without the interpreter's
    teardown (end_if_left_standing says why that teardown can abort)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say there
            pass
    os._exit(code)


@dataclass
class DistContext:
    env: ClusterEnv
    backend: str  # "nccl" | "gloo" | "none" (single process)
    device: torch.device
    initialized: bool
    timeout_s: float = 300.0
    owned: bool = True  # False: the group existed before (a benchmark pool): leave it standing
    # What holds the groups past destroy_process_group: DDP models, the Control channel (weak).
    _holders: list[weakref.ref[Any]] = field(default_factory=list, repr=False)

    @property
    def is_rank0(self) -> bool:
        return self.env.is_rank0

    def hold(self, holder: Any) -> None:
        """`holder` (a DDP model, a Control) keeps references to this job's groups: a clean
        destroy() makes it let go of them (see _release)."""
        self._holders.append(weakref.ref(holder))

    def destroy(self, barrier_timeout_s: float | None = 30.0) -> None:
        """Best-effort barrier (so no rank tears down while another still sends), then
        destroy_process_group. Never raises: it runs on the way out, often after an error.
        None: this rank failed alone (a raise in its training step): its peers wait in a
        collective for it, so neither a barrier (a non-zero rank's monitored_barrier waits for
        rank 0 for the whole process-group timeout) nor a teardown that waits for queued work;
        the process exits and srun --kill-on-bad-exit / the local launcher ends the peers."""
        global _watch, left_standing
        if not self.initialized or not self.owned or not dist.is_initialized():
            return
        if _watch is not None:
            _watch.close()
            _watch = None
        if barrier_timeout_s is None:
            self.initialized = False
            left_standing = True
            return
        try:
            if self.backend == "gloo":
                # monitored_barrier has its own timeout: a dead peer cannot hang the exit
                dist.monitored_barrier(timeout=timedelta(seconds=barrier_timeout_s))
            else:
                dist.barrier()
        except Exception:  # a peer already gone: nothing left to synchronise with
            pass
        try:
            dist.destroy_process_group()
        except Exception:  # already torn down by a failed collective: nothing to free
            pass
        self._release()
        self.initialized = False

    def _release(self) -> None:
        """After a clean destroy_process_group: make the holders drop the groups, so that they
        are freed and their worker threads joined while the interpreter lives. Why: destroy only
        unregisters a group that something still holds (DDP's reducer, logger and group; the
        Control channel), and its gloo threads then live on into the interpreter's finalization,
        where one that takes the GIL (dropping the callback of a Python comm hook: bf16
        compression, the rank-ordered sum, a user's own) is ended by CPython inside C++ code:
        std::terminate, SIGABRT after a run that succeeded. Freeing a group joins its threads
        with the GIL released (torch's destructor for groups), so a callback still running
        finishes first. The DDP models are of no use by then: their group is gone."""
        for ref in self._holders:
            holder = ref()
            if isinstance(holder, Control):
                holder.release()
            elif holder is not None:
                holder.reducer = holder.logger = holder.process_group = None
        self._holders.clear()


def start_watch(env: ClusterEnv) -> None:
    """The hang watch of a rank that just joined a group of several (group.py)."""
    global _watch
    _watch = hang.make(env)


# ------------------------------------------------------------ the hang watch's view of the rank
@contextmanager
def guard(what: str) -> Iterator[None]:
    """Run one collective as `what` ("the stop vote", ...): the process group's timeout bounds
    it, and a failure becomes one line naming the ranks that did not arrive (hang.py)."""
    w = _watch
    if w is None:
        yield
        return
    w.enter(what)
    try:
        yield
    except Exception as exc:
        if not hang.is_comm_failure(exc):
            raise
        raise w.diagnose(what, exc) from exc
    finally:
        w.leave()


def explain_failure(exc: BaseException) -> BaseException:
    """What to report for an exception that ends this rank (hang.Watch.explain)."""
    return _watch.explain(exc) if _watch is not None else exc


def watch_steps(stop: Any) -> None:
    """The hang watch reads the step this rank is at from the Job's StopFlag (current_step)."""
    if _watch is not None:
        _watch.steps = stop


# ------------------------------------------------------------ helpers on the default group
def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(group: Any = None, what: str = "a barrier") -> None:
    """All ranks of `group` (default: the job's) meet; a no-op with one process."""
    if _active():
        with guard(what):
            if group is None:
                dist.barrier()
            else:
                dist.barrier(group=group)


def broadcast_object(obj: Any, src: int = 0, what: str = "a broadcast") -> Any:
    """Rank `src`'s picklable object, on every rank."""
    if not _active():
        return obj
    box = [obj]
    with guard(what):
        dist.broadcast_object_list(box, src=src)
    return box[0]


T = TypeVar("T")


def rank0_decides(is_rank0: bool, decide: Callable[[], T], what: str) -> T:
    """Rank 0 runs `decide()` (reads files, hashes checkpoints: one reader) and every rank gets
    its answer. A DDPJobError it raises reaches every rank too, which then stop with the same
    line instead of waiting at a broadcast that would never come."""
    answer: Any = None
    if is_rank0:
        try:
            answer = decide()
        except DDPJobError as exc:
            answer = exc
    answer = broadcast_object(answer, what=what)
    if isinstance(answer, DDPJobError):
        raise answer
    return answer


def all_gather_object(obj: Any, what: str = "an all-gather", group: Any = None,
                      background: bool = False) -> list[Any]:
    """Every rank's picklable object, in rank order, on every rank (of `group`, default the
    job's). `background`: from a writer thread, outside the hang watch (as
    modelsync.dcp_save)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    if background:
        dist.all_gather_object(out, obj, group=group)
        return out
    with guard(what):
        dist.all_gather_object(out, obj, group=group)
    return out


def send_bytes(data: bytes, dst: int, group: Any, what: str) -> None:
    """`data` to rank `dst` over a CPU group: its length, then (if any) the bytes."""
    with guard(what):
        dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
        if data:
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


def recv_bytes(src: int, group: Any, what: str) -> bytes:
    """What send_bytes() on rank `src` sent to this rank."""
    size, buf = torch.zeros(1, dtype=torch.int64), torch.empty(0, dtype=torch.uint8)
    with guard(what):
        dist.recv(size, src, group=group)
        if int(size):
            buf = torch.empty(int(size), dtype=torch.uint8)
            dist.recv(buf, src, group=group)
    return buf.numpy().tobytes()


class Vote:
    """An agree() in flight: started after one step, read after the next (result())."""

    def __init__(self, values: list[int] | torch.Tensor, work: Any, what: str) -> None:
        self._t, self._work, self.what = values, work, what

    def result(self) -> list[int]:
        if self._work is not None:
            with guard(self.what):
                self._work.wait()
            self._work = None
        return [int(v) for v in self._t.tolist()] if isinstance(self._t, torch.Tensor) else list(self._t)


class Control:
    """The channel for small control messages: the per-step stop vote and the checkpoint
    barriers. Its own CPU (gloo) group: on NCCL a vote every step would sync the host with the
    GPU, and on gloo a vote in flight must not queue behind (or ahead of) DDP's gradient
    all-reduce on the default group."""

    def __init__(self, ctx: DistContext) -> None:
        self.active = ctx.initialized
        self.group: Any = None
        self._io: Any = None
        self._means: Any = None  # mean()'s group, made at its first call
        self._timeout = timedelta(seconds=ctx.timeout_s)
        if ctx.initialized:
            self.group = dist.new_group(backend="gloo")
            ctx.hold(self)

    def io_group(self) -> Any:
        """A third gloo group, for sharded checkpoints only (DCP's planning gathers and its final
        one): a background save runs them from its writer thread, which must never interleave
        with the stop vote on `group`. Made at first use, which every rank reaches together (a
        save or a resume is collective). None with one process."""
        if self.active and self._io is None:
            with guard("the creation of the checkpoint group"):
                self._io = dist.new_group(backend="gloo")
        return self._io

    def mean(self, values: list[float], what: str) -> list[float]:
        """The mean over the ranks of a few numbers (job.log's average), on a gloo group of its
        own, made at the first call (every rank calls it together). Why not the default group:
        a call that one rank makes and another does not met DDP's gradient all-reduce there,
        and gloo aborted the process on the size mismatch; here it waits, and the hang watch
        names the call and the ranks that went past it (hang.py, MISMATCH_S)."""
        if not self.active:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        with guard(what):
            if self._means is None:
                self._means = dist.new_group(backend="gloo", timeout=self._timeout)
            dist.all_reduce(t, group=self._means)
        return (t / dist.get_world_size()).tolist()

    def agree(self, values: list[int], what: str = "the stop vote") -> list[int]:
        """Element-wise MAX of small integers over all ranks: one all-reduce of a few int64s,
        so every rank takes the same decision at the same step."""
        if not self.active:
            return list(values)
        t = torch.tensor(list(values), dtype=torch.int64)
        with guard(what):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in t.tolist()]

    def start_agree(self, values: list[int], what: str = "the stop vote") -> Vote:
        """agree(), started in the background: the all-reduce travels while the next step
        computes, and Vote.result() waits for it (every rank reads it at the same step)."""
        if not self.active:
            return Vote(list(values), None, what)
        t = torch.tensor(list(values), dtype=torch.int64)
        with guard(what):
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return Vote(t, work, what)

    def barrier(self, what: str = "a barrier") -> None:
        if self.active:
            with guard(what):
                dist.barrier(group=self.group)

    def release(self) -> None:
        """Let go of the groups (after a clean destroy: DistContext._release)."""
        self.active, self.group, self._io, self._means = False, None, None, None


def all_reduce_(t: torch.Tensor, op: str = "sum", what: str = "an all-reduce") -> torch.Tensor:
    """In place over all ranks: "sum", "mean" or "max" (a no-op for one process)."""
    if not _active():
        return t
    with guard(what):
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    if op == "mean":
        t /= dist.get_world_size()
    return t


def broadcast_(t: torch.Tensor, src: int = 0, what: str = "a broadcast") -> torch.Tensor:
    """Rank `src`'s `t` on every rank, in place (a no-op for one process)."""
    if _active():
        with guard(what):
            dist.broadcast(t, src=src)
    return t


def group_active(group: Any = None) -> bool:
    """A process group exists and `group` (default: the job's) has more than one rank."""
    return (dist.is_available() and dist.is_initialized()
            and dist.get_world_size(group if group is not None else dist.group.WORLD) > 1)
