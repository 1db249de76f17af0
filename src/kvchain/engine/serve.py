"""`Engine`: serve a Hugging Face checkpoint through one kvchain pool.

The checkpoint's config is parsed by the same `models/` parsers `kvchain plan` uses, planned and
sized into one arena under a byte budget, and served by the scheduler of `scheduler.py` (continuous
batching, chunked prefill on the checkpoint grid, prefix reuse through the radix tree, exact
admission through `ChainPrefillBudget`) with the model's forward running on the device's forward
stream, overlapped with scheduling (`ModelPool`). Greedy decoding, or sampling (`sampling.py`)."""

from __future__ import annotations

import dataclasses
import numbers
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..build import build_kv_storage
from ..cache.hicache import host_pages_per_state
from ..cache.radix import CheckpointStrategy
from ..device.base import Device
from ..device.cuda import CudaDevice
from ..device.immediate import ImmediateDevice
from ..device.threads import ThreadDevice
from ..errors import InputError, KVChainError
from ..memory.host import stage_host_groups
from ..models.spec import ModelSpec
from ..plan import KVStoragePlan, plan_kv_storage
from ..sizing import size_plan, size_stages
from ..units import dtype_name, is_finite_number
from .checkpoint import (
    LOAD_DTYPES,
    LoadedCheckpoint,
    build_config,
    kv_cache_dtype,
    load_checkpoint,
    read_config,
)
from .logprobs import MAX_LOGPROBS
from .model_pool import ModelPool
from .pool import pool_checkpoint_interval
from .request import Phase, ScheduledRequest
from .runner import ModelRunner
from .sampling import SamplingParams, with_seeds
from .scheduler import Scheduler, check_step_budget
from .speculative_setup import DraftSetup, load_draft, speculative_pool


@dataclass(frozen=True)
class EngineConfig:
    """How the engine sizes and runs its pool.

    `budget_bytes`: the whole KV budget (arena plus fixed tables); `page_size`: tokens per page;
    `context_len`: the longest sequence (default: the model's, capped at 4096); `max_running`:
    requests in one batch; `max_batched_tokens`: tokens per forward (decodes plus prefill chunks);
    `overlap`: launch forward N+1 before processing N; `device`: `cpu` (forwards on worker-thread
    streams) or `cuda`; `prefix_cache`: reuse cached prefixes (attention, window rows, state
    checkpoints); `checkpoint_interval`: tokens between state checkpoints (models with recurrent
    state; default: the plan's); `ignore_eos`: run every request to its max_new_tokens; `inline`
    (cpu only): run every stream's work on the host thread as it is launched (`ImmediateDevice`)
    instead of on worker-thread streams. On a CPU the forward and the scheduler share one
    interpreter lock, so the worker threads hide no host work and each step pays their wake-ups
    (the schedule worker's upload, then the forward worker); inline runs the same loop and hooks
    with nothing in flight. `dtype`: what a checkpoint the engine loads from a path computes in (and
    keeps its KV in, unless `kv_cache_dtype` says otherwise): `auto` (the checkpoint's own, as
    serving engines' `--dtype auto`), `float32`, `bfloat16` or `float16`."""

    budget_bytes: int = 64 * 2**20
    page_size: int = 16
    context_len: int | None = None
    max_running: int = 64
    max_batched_tokens: int = 1024
    overlap: bool = True
    device: str = "cpu"
    prefix_cache: bool = True
    checkpoint_interval: int | None = None
    ignore_eos: bool = False
    inline: bool = False
    dtype: str = "auto"
    #: what the pool keeps attention K/V (and MLA latents) in: `auto` (the dtype the model computes
    #: in), or a name `units.dtype_name` takes (`fp8`: e4m3, the cast saturating, no scale)
    kv_cache_dtype: str = "auto"
    war_barrier: bool = True
    keep_logits: bool = False
    #: cpu only: seconds each forward starts late on its stream (tests that show a missing wait)
    forward_delay: float = 0.0
    #: bytes of host memory for the host tier (evicted prefixes backed up, loaded back on a match);
    #: None: no host tier
    host_budget: int | None = None
    #: speculative decoding: a draft checkpoint sharing the target's vocabulary (its layers fused into
    #: the target's plan) and the tokens it proposes per round (`speculative.py`)
    draft_model_path: str | Path | None = None
    num_speculative_tokens: int = 0
    #: a deliberate fault, for the test that shows it: a pipeline stage's relayed verify commit uses
    #: the state slots resolved at its forward's metadata time, not those of when it runs (LIFE-15)
    relayed_commit_slots_from_metadata: bool = False

    def __post_init__(self) -> None:
        """Sizes and counts are integers (never bools) and positive, where given: a zero or negative
        one would be read as "not given" or reach the chunk arithmetic (`mamba_prefill_chunk_grid`)."""
        for name in ("budget_bytes", "page_size", "max_running", "max_batched_tokens"):
            _positive(name, getattr(self, name))
        for name in ("context_len", "checkpoint_interval", "host_budget"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("overlap", "prefix_cache", "ignore_eos", "inline", "war_barrier", "keep_logits",
                     "relayed_commit_slots_from_metadata"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be a bool, not {getattr(self, name)!r}")
        if not isinstance(self.device, str):
            raise InputError(f"device must be a string such as 'cpu' or 'cuda', not {self.device!r}")
        if not is_finite_number(self.forward_delay) or self.forward_delay < 0:
            raise InputError(f"forward_delay must be a finite number of seconds >= 0, not {self.forward_delay!r}")
        if self.draft_model_path is not None and not isinstance(self.draft_model_path, (str, os.PathLike)):
            raise InputError(f"draft_model_path must be a path or None, not {self.draft_model_path!r}")
        if not isinstance(self.dtype, str) or (self.dtype != "auto" and self.dtype not in LOAD_DTYPES):
            raise InputError(f"dtype must be auto or one of {', '.join(LOAD_DTYPES)}, not {self.dtype!r}")
        kv_cache_dtype(self.kv_cache_dtype)  # refused here, where the config is made
        n = self.num_speculative_tokens
        if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0:
            raise InputError(f"num_speculative_tokens must be a non-negative integer, not {n!r}")


def _positive(name: str, value: object) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)) or value <= 0:
        raise InputError(f"{name} must be a positive integer, not {value!r}")


def check_host_tier(config: EngineConfig, what: str = "the prefix cache") -> None:
    """Refuse a host tier without the prefix cache it backs, before any checkpoint loads or any
    process starts."""
    if config.host_budget is not None and not config.prefix_cache:
        raise InputError(f"a host tier backs {what}: host_budget needs prefix caching on (prefix_cache; on the "
                         "command line, drop --no-prefix-cache)")


@dataclass(frozen=True)
class EnginePlan:
    """The pool an engine plans: the model's declarations, the plan (the draft's layers fused in
    when one is configured), the draft, and the longest sequence."""

    spec: ModelSpec
    plan: KVStoragePlan
    draft: DraftSetup | None
    context: int

    @property
    def interval(self) -> int | None:
        """The checkpoint interval the pool is handed (the draft's; None: the config's)."""
        return None if self.draft is None else self.draft.checkpoint_interval


def engine_plan(checkpoint: LoadedCheckpoint, config: EngineConfig, device: torch.device,
                tp_size: int = 1) -> EnginePlan:
    """The pool an engine for `checkpoint` under `config` plans (a rank's share of the heads over
    `tp_size` ranks), the draft loaded onto `device` and fused in when configured: what an engine
    and a rank compute as they start, and what is checked before a split engine's processes start."""
    spec = checkpoint.model_spec(kv_cache_dtype(config.kv_cache_dtype), tp_size=tp_size)
    draft = None
    if config.draft_model_path is not None or config.num_speculative_tokens:
        draft = load_draft(config, checkpoint, device, tp_size=tp_size)
    plan = plan_kv_storage(spec.decls, page_size=config.page_size) if draft is None else draft.plan
    return EnginePlan(spec, plan, draft, engine_context(config.context_len, spec))


def check_engine_start(checkpoint: LoadedCheckpoint, config: EngineConfig) -> None:
    """What a one-process engine for `checkpoint` refuses as it starts (`check_process_plans`), asked
    before the processes that each run one (the PD nodes) start."""
    planned = engine_plan(checkpoint, config, torch.device("cpu"))
    check_process_plans([planned.plan], config, planned.context, planned.interval)


def check_process_plans(plans: Sequence[KVStoragePlan], config: EngineConfig, context: int,
                        interval: int | None) -> None:
    """What each process of a split engine refuses as its engine starts, asked of its plan by the
    process that would start them: a budget under a plan's batch-size-1 floor (`size_stages`: one
    plan per pipeline stage, or a rank's one), a step's token budget under the checkpoint interval
    (`check_step_budget`), a host budget that holds no host page (`stage_host_groups`). The refusal
    is then one line before any process starts, not a process's error read back after they all
    did. `interval`: the pool option every process passes (a draft's), None for the config's."""
    size_stages(list(plans), config.budget_bytes, context_len=context, max_running_requests=config.max_running)
    # every process keeps one interval: the stages are handed the whole model's (PP-2)
    kept = pool_checkpoint_interval(plans[0], interval if interval is not None else config.checkpoint_interval)
    check_step_budget(config.max_batched_tokens, config.max_running, kept)
    if config.host_budget is not None:
        stage_host_groups(list(plans), config.host_budget, host_pages_per_state(plans[0], kept))


@dataclass(frozen=True)
class GenerateRequest:
    """One request: its prompt's token ids, at most `max_new_tokens` new tokens, sampled greedily
    or as `sampling` says (`engine.sampling.SamplingParams`: temperature, top-k, top-p, seed)."""

    prompt_token_ids: Sequence[int]
    max_new_tokens: int = 16
    sampling: SamplingParams | None = None
    #: token ids that end it besides the model's end-of-sequence ids (`ignore_eos` leaves these on)
    stop_token_ids: Sequence[int] = ()
    #: report each output token's log-probability with this many likeliest alternatives (None: none)
    logprobs: int | None = None


def handed_out(path: str | Path, requests: Sequence[GenerateRequest]) -> list[GenerateRequest]:
    """`requests` as the process that hands them to a split engine's processes passes them on: each
    checked as `Engine.generate` checks it (`checked_prompt`, against the vocabulary the config of the
    checkpoint at `path` declares), so a bad one is refused in one line before any process starts,
    not by one process while its peers fail on the link it left; and seeded once
    (`sampled_requests`), so that all of them sample alike."""
    requests = sampled_requests(requests)
    if requests:
        path = Path(path)
        vocab = getattr(build_config(path, read_config(path)).get_text_config(), "vocab_size", None)
        if isinstance(vocab, int) and vocab > 0:
            for i, r in enumerate(requests):
                checked_prompt(i, r, vocab)
    return requests


def _plain_int(value):
    """A numpy integer as a Python int (what a tokenizer or an array hands over); anything else as is,
    for the checks to judge."""
    return int(value) if isinstance(value, np.integer) else value


def _plain_ints(r: GenerateRequest) -> GenerateRequest:
    """`r` with numpy integers in its counts and stop ids made Python ints, so they pass the checks as
    the integers they are and travel to other processes as JSON does."""
    stop = r.stop_token_ids
    if isinstance(stop, np.ndarray) and stop.dtype.kind in "iu":
        stop = tuple(int(t) for t in stop.reshape(-1))
    elif isinstance(stop, (list, tuple)) and any(isinstance(t, np.integer) for t in stop):
        stop = tuple(_plain_int(t) for t in stop)
    changes = {"max_new_tokens": _plain_int(r.max_new_tokens), "logprobs": _plain_int(r.logprobs),
               "stop_token_ids": stop}
    if all(changes[k] is getattr(r, k) for k in changes):
        return r
    return dataclasses.replace(r, **changes)


def sampled_requests(requests: Sequence[GenerateRequest]) -> list[GenerateRequest]:
    """`requests` (any iterable of `GenerateRequest`, read once) as a list, with a seed for each
    sampled one that has none (`sampling.with_seeds`): what a process hands to others, so that all
    of them sample alike. InputError for anything but an iterable of `GenerateRequest`s."""
    if isinstance(requests, (str, bytes, dict)) or not isinstance(requests, Iterable):
        raise InputError(f"requests must be a sequence of GenerateRequest, not {type(requests).__name__}")
    requests = list(requests)  # a generator is read once, here
    for i, r in enumerate(requests):
        if not isinstance(r, GenerateRequest):
            raise InputError(f"request {i}: a GenerateRequest, not {type(r).__name__}")
        requests[i] = r = _plain_ints(r)
        if r.sampling is not None and not isinstance(r.sampling, SamplingParams):
            raise InputError(f"request {i}: sampling must be a SamplingParams, not {type(r.sampling).__name__}")
    params = with_seeds([r.sampling for r in requests])
    return [r if p is r.sampling or (p.greedy and r.sampling is None) else dataclasses.replace(r, sampling=p)
            for r, p in zip(requests, params)]

@dataclass
class GenerateOutput:
    """One request's new tokens (only those: the prompt is not repeated), and why it stopped:
    `length` (max_new_tokens, or the memory clip when `clipped`), `eos`, `stop` (one of its
    `stop_token_ids`), or `rejected`/`aborted`
    with the reason."""

    index: int
    token_ids: list[int]
    finish_reason: str
    cached_tokens: int = 0
    reason: str = ""
    #: per output token, when the request asked: {"token_id", "logprob", "top": [[id, logprob], ...]}
    logprobs: list[dict] | None = None

    def to_dict(self) -> dict:
        return {"index": self.index, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "cached_tokens": self.cached_tokens, **({"reason": self.reason} if self.reason else {}),
                **({"logprobs": self.logprobs} if self.logprobs is not None else {})}


@dataclass
class GenerateStats:
    requests: int = 0
    steps: int = 0
    forwards: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0
    peak_running: int = 0
    compaction_moves: int = 0
    checkpoints: int = 0
    window_pages_retired: int = 0
    peak_utilisation: float = 0.0
    #: times the allocator relocated a float band (a window sub-pool between the chain's ends)
    float_relocations: int = 0
    #: the host tier: matches a load from the host lengthened, nodes backed up, loads, and the
    #: bytes of its host pools (0: no host tier)
    host_hits: int = 0
    host_backups: int = 0
    host_loads: int = 0
    host_bytes: int = 0
    #: speculative decoding: rounds verified, draft tokens proposed and accepted, draft forwards
    spec_rounds: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    draft_forwards: int = 0
    #: rounds whose request was retracted while they ran (their results dropped)
    spec_dropped: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.output_tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__},
                "tokens_per_second": self.tokens_per_second, "prefix_hit_rate": self.prefix_hit_rate,
                # speculative decoding's figures exist only where a draft proposed tokens
                "acceptance_rate": self.acceptance_rate if self.spec_rounds else None,
                "tokens_per_target_forward": self.tokens_per_target_forward if self.spec_rounds else None}


@dataclass
class GenerateResult:
    outputs: list[GenerateOutput]
    stats: GenerateStats
    #: (request index, output number) -> logits of that sampled token, when `keep_logits`
    logits: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)

def open_checkpoint(checkpoint: LoadedCheckpoint | str | Path,
                    config: EngineConfig) -> tuple[Device, torch.device, LoadedCheckpoint]:
    """The device backend `config` asks for and the checkpoint on it (a path is loaded there): the
    opening every engine shares, one process or a stage or rank of several."""
    backend, torch_device = _backend(config.device, config.forward_delay, config.inline)
    if not isinstance(checkpoint, LoadedCheckpoint):
        checkpoint = load_checkpoint(checkpoint, device=torch_device, dtype=config.dtype)
    elif config.dtype != "auto" and checkpoint.dtype != LOAD_DTYPES[config.dtype]:
        raise InputError(f"dtype {config.dtype} applies to a checkpoint the engine loads; this one is loaded "
                         f"in {dtype_name(checkpoint.dtype)} (load it in {config.dtype}, or pass its path)")
    return backend, torch_device, checkpoint


def pool_options(config: EngineConfig, checkpoint: LoadedCheckpoint, plan, *, overlap: bool,
                 interval: int | None = None) -> dict:
    """`ModelPool`'s keyword arguments from an engine's config; `interval` defaults to the config's
    checkpoint interval where the plan holds state."""
    if interval is None and plan.state is not None:
        interval = config.checkpoint_interval
    return dict(overlap=overlap, war_barrier=config.war_barrier,
                eos=() if config.ignore_eos else checkpoint.eos_token_ids,
                keep_logits=config.keep_logits, prefix_cache=config.prefix_cache,
                strategy=CheckpointStrategy.EXTRA_BUFFER, checkpoint_interval=interval,
                max_tokens=config.max_batched_tokens + config.max_running)



def _backend(device: str, forward_delay: float, inline: bool = False) -> tuple[Device, torch.device]:
    if inline and device != "cpu":
        raise InputError(f"inline runs a cpu engine's streams on the host thread; device {device!r} has its own")
    if inline and forward_delay:
        raise InputError("a forward delay needs worker-thread streams (inline runs each forward at launch)")
    if device == "cpu":
        return (ImmediateDevice() if inline else ThreadDevice(forward_delay)), torch.device("cpu")
    if device == "cuda":
        return CudaDevice("cuda"), torch.device("cuda")
    raise InputError(f"device must be cpu or cuda, not {device!r}")


def checked_prompt(i: int, request: GenerateRequest, vocab: int) -> np.ndarray:
    """Request `i`'s prompt as int64 ids, refused (`InputError`) unless every id is an integer in
    [0, vocab) and `max_new_tokens` a positive integer."""
    raw = request.prompt_token_ids
    try:
        ids = None if isinstance(raw, (str, bytes)) else list(raw)
    except TypeError:
        ids = None
    if ids is None:
        raise InputError(f"request {i}: prompt_token_ids must be a sequence of token ids, not {type(raw).__name__}")
    if not ids:
        raise InputError(f"request {i}: a prompt needs at least one token id")
    if np.asarray(ids).dtype.kind in "fbcUSV":  # floats, bools, strings: no cast makes them ids
        raise InputError(f"request {i}: token ids must be integers in [0, {vocab})")
    try:
        prompt = np.asarray(ids, dtype=np.int64)
    except OverflowError:  # an integer past int64 is past the vocabulary too
        raise InputError(f"request {i}: token ids must lie in [0, {vocab}) for this model") from None
    except (TypeError, ValueError):
        raise InputError(f"request {i}: token ids must be integers in [0, {vocab})") from None
    if prompt.ndim != 1 or not len(prompt):
        raise InputError(f"request {i}: a prompt needs at least one token id")
    if prompt.min() < 0 or prompt.max() >= vocab:
        raise InputError(f"request {i}: token ids must lie in [0, {vocab}) for this model")
    n = request.max_new_tokens
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InputError(f"request {i}: max_new_tokens must be a positive integer, not {n!r}")
    stop = request.stop_token_ids
    if (isinstance(stop, (str, bytes)) or not isinstance(stop, Iterable)
            or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in stop)):
        raise InputError(f"request {i}: stop_token_ids must be integers in [0, {vocab}), not {stop!r}")
    lp = request.logprobs
    if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
        raise InputError(f"request {i}: logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, not {lp!r}")
    return prompt


def finish_reason(output: Sequence[int], max_new: int, stop: frozenset) -> str:
    """Why a finished request's `output` ended: `stop` on one of its own stop ids, `eos` on the
    model's end of sequence, `length` at `max_new` tokens."""
    if len(output) >= max_new:
        return "length"
    return "stop" if len(output) and int(output[-1]) in stop else "eos"


def engine_context(context_len: int | None, spec) -> int:
    """The longest sequence an engine serves: `context_len` when given, else the model's capped at
    4,096."""
    return context_len or min(spec.max_context or 4096, 4096)


class Engine:
    """One model, one pool, one prefix cache that outlives each `generate` call."""

    #: why an earlier `generate` stopped mid-run (None: it never did); the pool then holds what that
    #: run left (rows, forwards in flight), so the engine serves nothing more. A class default:
    #: the split engines' processes build their engines without `Engine.__init__`
    _failed: str | None = None

    def __init__(self, checkpoint: LoadedCheckpoint | str | Path, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        check_host_tier(config)  # before the checkpoint loads
        backend, torch_device, checkpoint = open_checkpoint(checkpoint, config)
        self.checkpoint = checkpoint
        planned = engine_plan(checkpoint, config, torch_device)
        self.plan, draft = planned.plan, planned.draft
        sizing = size_plan(self.plan, config.budget_bytes, context_len=planned.context,
                           max_running_requests=config.max_running)
        self.storage = build_kv_storage(self.plan, sizing, torch_device, backend=backend)
        self.runner = ModelRunner(checkpoint.model, self.plan)
        pool_kwargs = pool_options(config, checkpoint, self.plan, overlap=config.overlap, interval=planned.interval)
        if draft is not None:
            self.pool = speculative_pool(self.storage, self.runner, draft, config, pool_kwargs)
        else:
            self.pool = ModelPool(self.storage, self.runner, **pool_kwargs)
        check_step_budget(config.max_batched_tokens, config.max_running, self.pool.checkpoint_interval)
        if config.host_budget is not None:
            self.pool.enable_host_tier(config.host_budget)
        self._rid = 0

    def generate(self, requests: Sequence[GenerateRequest],
                 progress: Callable[[int, int], None] | None = None) -> GenerateResult:
        """Serve every request to its end; outputs come back in input order. `progress(done, total)`
        is called after each step. The pool is checked idle at the end (no leak, no page pending).
        Requests are checked before anything runs, so a refused one leaves the engine serving; an
        error once the run has started (a forward that fails) leaves it stopped, and every later
        call says so rather than serve from what that run left."""
        if self._failed is not None:
            raise KVChainError(f"this engine stopped when an earlier generate failed mid-run ({self._failed}); "
                               "close it and build a new Engine")
        cfg = self.config
        vocab = int(self.checkpoint.model.get_input_embeddings().num_embeddings)
        requests = sampled_requests(requests)
        reqs = []
        context = self.storage.table.context_len
        asked = []
        for i, r in enumerate(requests):
            prompt = checked_prompt(i, r, vocab)
            asked.append(r.max_new_tokens)
            # no sequence outgrows the context: what lies past it is never generated nor held
            max_new = min(r.max_new_tokens, context)
            rid = self._rid
            self._rid += 1
            reqs.append(ScheduledRequest(rid=rid, arrival=0, prompt=prompt, max_new=max_new, output_len=max_new,
                                         output=np.zeros(max_new, dtype=np.int64), sampling=r.sampling,
                                         stop=frozenset(int(t) for t in r.stop_token_ids), logprobs=r.logprobs))
        scheduler = Scheduler(self.pool, max_batched_tokens=cfg.max_batched_tokens, max_running=cfg.max_running)
        scheduler.add(reqs)
        before = dict(self.pool.stats_counters)
        host0 = dict(self.pool.hicache.stats) if self.pool.hicache is not None else None
        counters = self.pool.counters
        forwards0 = counters.forwards
        before_storage = self.storage.stats()
        moves0, relocations0 = before_storage.moves, before_storage.relocations
        spec0 = dataclasses.replace(self.pool.spec) if hasattr(self.pool, "spec") else None
        peak = 0.0
        t0 = time.perf_counter()

        def tick(s: Scheduler) -> None:
            nonlocal peak
            peak = max(peak, s.stats.history[-1].utilisation)
            if progress is not None:
                progress(len(s.done), len(reqs))

        try:
            scheduler.run(progress=tick)
            self.pool.drain()
            seconds = time.perf_counter() - t0
            self.pool.steps.flush()  # compaction at idle: nothing in flight, so every move is free to run
            self.storage.device.synchronize()
            self.pool.check_idle()
        except BaseException as e:
            self._failed = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise
        outputs = []
        for i, req in enumerate(reqs):
            n = req.generated if req.phase is Phase.FINISHED else 0
            n = min(n, req.output_len)
            if req.phase is not Phase.FINISHED:
                reason = req.phase.value
            else:
                reason = finish_reason(req.output[:n], req.max_new, req.stop)
            clipped = req.phase is Phase.FINISHED and req.max_new < asked[i]
            by = "the context length" if req.input_len + asked[i] > context else "memory"
            logprobs = None
            if req.logprobs is not None:
                logprobs = [self.pool.counters.logprobs.pop((req.rid, j)) for j in range(n)]
            outputs.append(GenerateOutput(i, [int(t) for t in req.output[:n]], reason, int(req.cached),
                                          f"max_new_tokens clipped to {req.max_new} by {by}" if clipped
                                          else req.reason, logprobs))
        stats = GenerateStats(
            requests=len(reqs), steps=scheduler.stats.steps, forwards=counters.forwards - forwards0,
            prompt_tokens=sum(r.prompt_len for r in reqs), output_tokens=sum(len(o.token_ids) for o in outputs),
            cached_tokens=scheduler.stats.cached_tokens, seconds=seconds, peak_running=scheduler.stats.peak_running,
            compaction_moves=self.storage.stats().moves - moves0,
            checkpoints=self.pool.stats_counters["checkpoints"] - before["checkpoints"],
            window_pages_retired=self.pool.stats_counters["window_retired"] - before["window_retired"],
            peak_utilisation=peak, float_relocations=self.storage.stats().relocations - relocations0)
        if host0 is not None:
            host = self.pool.hicache.stats
            stats.host_hits = host["host_hits"] - host0["host_hits"]
            stats.host_backups = host["backups"] - host0["backups"]
            stats.host_loads = host["loads"] - host0["loads"]
            stats.host_bytes = self.pool.hicache.host.nbytes
        spec_stats = getattr(self.pool, "spec", None)
        if spec_stats is not None:
            stats.spec_rounds = spec_stats.rounds - spec0.rounds
            stats.spec_proposed = spec_stats.proposed - spec0.proposed
            stats.spec_accepted = spec_stats.accepted - spec0.accepted
            stats.draft_forwards = spec_stats.draft_forwards - spec0.draft_forwards
            stats.spec_dropped = spec_stats.dropped - spec0.dropped
        logits = {}
        if cfg.keep_logits:
            index = {r.rid: i for i, r in enumerate(reqs)}
            logits = {(index[rid], j): v for (rid, j), v in counters.logits.items() if rid in index}
        return GenerateResult(outputs, stats, logits)

    def close(self) -> None:
        """Stop the device's stream workers."""
        self.storage.device.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
