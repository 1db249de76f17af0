"""Pipeline stages as real processes over torch.distributed (gloo on the loopback interface).

`StageLink` is what one stage says to the others: the all-gather of every stage's geometry when the
pipeline loop starts (PP-6), and each iteration's capacity digest, sent to the next stage and
received from the previous one (PP-15). Every wait is bounded: a stage that stops answering makes
its neighbour raise `TransferTimeoutError` instead of hanging. `run_stage_processes` starts one
process per stage on a free loopback port, collects what each returns, and ends every process it
started, whatever happened."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import KVChainError, TransferTimeoutError

#: bytes of one digest on the wire (`StageCapacity.take_digest` returns 32 hex characters)
DIGEST_BYTES = 32


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_env(port: int) -> dict[str, str]:
    """The environment a stage process joins the group with: gloo on `lo`, rendezvous on `port`."""
    return {"GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


class StageLink:
    """One stage's link to the other stages of its process group. `ranks` names each stage's
    process in the group and `group` is the stages' own group, where stages are one dimension of a
    larger group (tensor-parallel ranks within stages); by default stage i is process i."""

    def __init__(self, stage: int, n_stages: int, timeout_s: float, ranks: Sequence[int] | None = None,
                 group: Any = None) -> None:
        self.stage = stage
        self.n_stages = n_stages
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(n_stages))
        self.group = group

    @classmethod
    def join(cls, stage: int, n_stages: int, port: int, timeout_s: float = 30.0) -> StageLink:
        """Join the group of `n_stages` stages on 127.0.0.1:`port` over gloo."""
        os.environ.update(loopback_env(port))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=stage, world_size=n_stages,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return cls(stage, n_stages, timeout_s)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every stage's `obj`, in stage order (the geometries when the loop starts, PP-6)."""
        out: list[Any] = [None] * self.n_stages
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def send_next(self, digest: str) -> None:
        """Send this iteration's digest to the next stage (the last stage sends nothing)."""
        if self.stage + 1 >= self.n_stages:
            return
        data = digest.encode()
        if len(data) != DIGEST_BYTES:
            raise KVChainError(f"a stage digest is {DIGEST_BYTES} bytes, got {len(data)}")
        work = dist.isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), self.ranks[self.stage + 1])
        self._wait(work, "send to", self.stage + 1)

    def recv_previous(self) -> str | None:
        """The previous stage's digest of this iteration (None on the first stage)."""
        if self.stage == 0:
            return None
        buf = torch.zeros(DIGEST_BYTES, dtype=torch.uint8)
        self._wait(dist.irecv(buf, self.ranks[self.stage - 1]), "receive from", self.stage - 1)
        return bytes(buf.tolist()).decode()

    def send_tensor(self, tensor: torch.Tensor, peer: int) -> None:
        """Send `tensor` (a stage's hidden states, the last stage's logits) to stage `peer`."""
        data = tensor.detach().contiguous().cpu()  # referenced until the send is done
        self._wait(dist.isend(data, self.ranks[peer]), "send to", peer, "tensor")

    def recv_tensor(self, shape: tuple[int, ...], dtype: torch.dtype, peer: int) -> torch.Tensor:
        """A tensor of `shape` and `dtype` from stage `peer` (both stages know its shape)."""
        buf = torch.empty(shape, dtype=dtype)
        self._wait(dist.irecv(buf, self.ranks[peer]), "receive from", peer, "tensor")
        return buf

    def _wait(self, work, what: str, peer: int, payload: str = "digest") -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise TransferTimeoutError(f"stage {self.stage}: {payload} {what} stage {peer} did not finish within "
                                       f"{self.timeout.total_seconds():g} s ({e})") from None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _child(target: Callable[..., Any], stage: int, n_stages: int, port: int, env: dict[str, str], args: tuple,
           results) -> None:
    os.environ.clear()  # the caller's environment now, not the one the fork server started with
    os.environ.update(env)
    torch.set_num_threads(1)  # one process per core: no stage's thread pool competes with another's
    try:
        results.put((stage, "ok", target(stage, n_stages, port, *args)))
    except BaseException as e:  # the parent reads every outcome, an error's text included
        results.put((stage, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))


#: what the fork server imports once, so that no stage process it forks spends seconds importing
#: torch, the engine and transformers' model code again
FORK_SERVER_PRELOAD = ["kvchain.dist.pp", "kvchain.engine.checkpoint", "transformers.modeling_utils",
                       "transformers.generation.utils"]


def stage_context(start_method: str | None = None):
    """The multiprocessing context stage processes start from. By default a fork server: a clean
    process, started once, that imported torch and has run nothing, so that a stage never inherits
    its caller's state. A plain fork copies whatever the caller's libraries hold: MKL's allocator
    table (a forked child that had run a matmul before can spin in it for ever), a thread's held
    lock, an initialised CUDA context. Where there is no fork server, spawn."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


def start_stage_server(start_method: str | None = None) -> None:
    """Start the fork server now (seconds: it imports `FORK_SERVER_PRELOAD`), so that the first
    `run_stage_processes` starts its processes as fast as the later ones do."""
    if stage_context(start_method).get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def run_stage_processes(target: Callable[..., Any], n_stages: int, args: tuple = (), *, timeout_s: float = 60.0,
                        env: dict[str, str] | None = None, start_method: str | None = None
                        ) -> dict[int, tuple[str, Any]]:
    """Run `target(stage, n_stages, port, *args)` in one process per stage and return each stage's
    ("ok", result) or ("error", text), in the order the reports arrived (`failures` reads
    that order). Stops waiting at the first error or after `timeout_s`; a stage that did not
    report comes after those that did, as ("timeout", None), or ("timeout", text) naming the exit
    code of a process that ended on its own without reporting. Every process it started is ended before it
    returns. Processes start from `stage_context(start_method)`: `target` and `args` are pickled
    (a module-level function), and each process runs with this process's environment as it is
    now, updated with `env`."""
    ctx = stage_context(start_method)
    results = ctx.Queue()
    port = free_port()
    child_env = {**os.environ, **loopback_env(port), **(env or {})}
    procs = [ctx.Process(target=_child, args=(target, s, n_stages, port, child_env, args, results), daemon=True)
             for s in range(n_stages)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n_stages:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                stage, status, value = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            out[stage] = (status, value)
            if status == "error":  # the others may be failing too: a moment to hear from them
                deadline = min(deadline, time.monotonic() + 2.0)
    finally:
        for p in procs:
            p.join(timeout=2.0 if len(out) == n_stages else 0.1)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
    for s in range(n_stages):
        if s not in out:  # say how it ended: still running (ended here) or its exit code
            code = procs[s].exitcode
            out[s] = ("timeout", None if code in (None, -15, -9) else f"ended with exit code {code} without a report")
    return out


def failures(out: dict[int, tuple[str, Any]]) -> list[tuple[int, str, str]]:
    """The stages of a `run_stage_processes` result that did not end "ok", as (stage, status, first
    line), in the order they reported: the first is the root cause, since a stage that fails first
    reports first and its peers fail after it, on the link it left (a stage that never reported
    comes last)."""
    return [(s, status, str(value).splitlines()[0] if value else "no answer within the time allowed")
            for s, (status, value) in out.items() if status != "ok"]
