"""Pipeline stages of the engine: a checkpoint's layers split across processes, each stage serving
its own layers from its own pool, outputs identical to one process.

Each stage process loads the checkpoint and replaces the decoder layers other stages host with
pass-throughs (`keep_stage_layers`), plans and sizes only its own layers (`plan_stages`,
`size_stages`: its arena's bytes follow them, PP-1), all-gathers the stages' geometries and installs
them (PP-6), so every capacity question is asked of every stage's snapshot and every stage's
scheduler takes the same decisions with no relay (PP-7..10). A step's forward runs stage by stage:
the first stage embeds the tokens and runs its layers, the hidden states go to the next stage
(`StageRunner`), the last stage's logits come back to every stage, and each samples the same
tokens. After each step each stage sends its capacity digest to the next, which checks it
(`chain.stage_capacity_agreement`, PP-15, PP-16). A stage runs each forward to its end before it
schedules the next (no micro-batch overlap)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..alloc.stage_capacity import StageGeometry, check_stage_agreement
from ..build import build_kv_storage
from ..cache.checkpoints import default_checkpoint_interval
from ..cache.hicache import host_pages_per_state
from ..decl import KVLayerDecl
from ..engine.batch import ForwardBatch
from ..engine.checkpoint import LoadedCheckpoint
from ..engine.model_pool import ModelPool
from ..engine.runner import ModelRunner
from ..engine.serve import (
    Engine,
    EngineConfig,
    GenerateRequest,
    GenerateResult,
    check_host_tier,
    check_process_plans,
    engine_plan,
    handed_out,
    open_checkpoint,
    pool_options,
)
from ..engine.speculative_plan import plan_with_draft
from ..engine.speculative_setup import DraftSetup, speculative_pool
from ..errors import InputError, InvariantError
from ..memory.host import stage_host_groups
from ..plan import KVStoragePlan, plan_kv_storage, plan_stages, stage_layer_ranges
from ..sizing import size_stages
from .pp import StageLink, failures, run_stage_processes
from .pp_spec import RelayedSpeculativePool


class PassThroughLayer(torch.nn.Module):
    """A decoder layer another stage hosts: the hidden states pass on unchanged, in what the layer it
    stands for returns (`as_tuple`: a one-element tuple, for a model whose loop takes element 0)."""

    def __init__(self, hosted_by: int, as_tuple: bool = False) -> None:
        super().__init__()
        self.hosted_by = hosted_by
        self.as_tuple = as_tuple

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor]:
        return (hidden_states,) if self.as_tuple else hidden_states


def returns_tuple(layer: torch.nn.Module) -> bool:
    """Whether a decoder layer hands its model a tuple (the hidden states first) rather than the
    hidden states: Falcon-H1's does, and its model's loop takes element 0 of what each layer
    returns, so a pass-through returning the bare hidden states had the next layer read one row of
    them. Read from the layer's own return statements (annotations say tuple for layers that return
    a tensor); a layer whose source cannot be read is taken to return the hidden states."""
    try:
        source = inspect.getsource(type(layer).forward)
    except (OSError, TypeError):
        return False
    returned = re.findall(r"^\s*return\s+(.+)$", source, re.MULTILINE)
    return bool(returned) and all(value.lstrip().startswith("(") for value in returned)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's list of decoder layers (`model.model.layers` for the families served): one per
    config layer, or one per `per_decoder_layer(model)` of them."""
    n = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    blocks = int(getattr(model.config, "num_layers", n) or n)  # LongCat-Flash: two attentions per layer
    for name, module in model.named_modules():
        if name.endswith("layers") and isinstance(module, torch.nn.ModuleList) and len(module) in (n, blocks):
            return module
    raise InputError(f"{type(model).__name__}: no list of {n} decoder layers to split into stages")


def per_decoder_layer(model: torch.nn.Module) -> int:
    """How many of the config's layers (the plan's layer ids) one decoder layer holds: 1, or 2 for
    LongCat-Flash, whose layer runs two attentions and whose `num_hidden_layers` counts them."""
    return int(model.config.num_hidden_layers) // len(decoder_layers(model))


def check_stage_blocks(model: torch.nn.Module, ranges: Sequence[range]) -> None:
    """Refuse stage ranges that would split a decoder layer's attentions between stages."""
    per = per_decoder_layer(model)
    cut = [r for r in ranges if r.start % per or r.stop % per]
    if cut:
        raise InputError(f"{type(model).__name__}: each decoder layer holds {per} of its {model.config.num_hidden_layers} "
                         f"layers, so a stage must start and end on a multiple of {per} (layers {cut[0].start}.."
                         f"{cut[0].stop - 1} do not)")


def check_stage_inputs(model: torch.nn.Module) -> None:
    """Refuse a model whose decoder layers read more than the previous layer's hidden states: a stage
    receives only those. Zamba's and Zamba2's hybrid layers also read the embeddings
    (`original_hidden_states`), which a stage after the first would take from its input instead
    (its tokens then differ from one process's)."""
    taking = sorted({type(layer).__name__ for layer in decoder_layers(model)
                     if "original_hidden_states" in inspect.signature(layer.forward).parameters})
    if taking:
        raise InputError(f"{type(model).__name__}: its decoder layers ({', '.join(taking)}) take the embeddings "
                         "(original_hidden_states) beside the hidden states, and pipeline stages pass on only "
                         "the hidden states; serve it without --pp")


def keep_stage_layers(model: torch.nn.Module, layers: range, owner: Callable[[int], int]) -> None:
    """Replace every decoder layer outside `layers` (the plan's layer ids) by a pass-through
    (`owner(i)`: the stage of layer id `i`)."""
    check_stage_inputs(model)
    stack, per = decoder_layers(model), per_decoder_layer(model)
    for i in range(len(stack)):
        if i * per not in layers:
            stack[i] = PassThroughLayer(owner(i * per), returns_tuple(stack[i]))


class _Cut(Exception):
    """Raised by the hook on a stage's last layer: the forward stops there with its hidden states."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("stage output")
        self.hidden = hidden


class StageRunner(ModelRunner):
    """The forward of one stage: its own layers of the model, the hidden states received from the
    previous stage (the first embeds the tokens) and sent to the next; the last stage's logits
    go back to every stage, so every stage samples the same tokens."""

    def __init__(self, model: torch.nn.Module, plan, stage: int, ranges: Sequence[range], link: StageLink,
                 relay: bool = False) -> None:
        layers = ranges[stage]
        check_stage_blocks(model, ranges)
        keep_stage_layers(model, layers, lambda i: next(s for s, r in enumerate(ranges) if i in r))
        super().__init__(model, plan)
        self.stage = stage
        self.n_stages = len(ranges)
        self.link = link
        self.first = stage == 0
        self.last = stage == self.n_stages - 1
        self.hidden_size = int(model.config.get_text_config().hidden_size)
        self.vocab = int(model.get_input_embeddings().num_embeddings)
        #: a stage before the last whose logits are relayed: its forward ends once it has sent its
        #: hidden states on, and `relayed_logits` receives the last stage's later
        self.relays_logits = relay and not self.last
        if not self.last:
            decoder_layers(model)[layers.stop // per_decoder_layer(model) - 1].register_forward_hook(self._cut)

    @staticmethod
    def _cut(_module, _args, output) -> None:
        raise _Cut(output[0] if isinstance(output, tuple) else output)

    @torch.inference_mode()
    def logits(self, batch: ForwardBatch, input_ids: torch.Tensor, positions: torch.Tensor,
               sample_at: torch.Tensor) -> torch.Tensor | None:
        link, n_tokens, n_sample = self.link, int(input_ids.shape[0]), int(sample_at.shape[0])
        kwargs = {"position_ids": positions[None], "use_cache": False, "kvchain_batch": batch, **self._masks}
        if self.first:
            inputs = {"input_ids": input_ids[None]}
        else:
            hidden = link.recv_tensor((1, n_tokens, self.hidden_size), self.dtype, self.stage - 1)
            inputs = {"inputs_embeds": hidden.to(self.device)}
        if self.last:
            logits = self.model(**inputs, logits_to_keep=sample_at, **kwargs).logits[0].float()
            for stage in range(self.n_stages - 1):
                if n_sample:
                    link.send_tensor(logits, stage)
            return logits
        try:
            self.model(**inputs, logits_to_keep=sample_at, **kwargs)
        except _Cut as cut:
            link.send_tensor(cut.hidden, self.stage + 1)
        else:
            raise InvariantError("engine.stage_cut", f"stage {self.stage}'s last layer never ran")
        if self.relays_logits:
            return None
        return self.relayed_logits(n_sample)

    def relayed_logits(self, n_sample: int) -> torch.Tensor:
        """The last stage's logits of this stage's forward (`[n_sample, vocab]`)."""
        if not n_sample:
            return torch.empty((0, self.vocab), dtype=torch.float32, device=self.device)
        return self.link.recv_tensor((n_sample, self.vocab), torch.float32, self.n_stages - 1).to(self.device)


class StageEngine(Engine):
    """One pipeline stage of an `Engine`: its own layers, its own pool, the stages' geometries
    installed on its chain, and its capacity digest checked against the previous stage's after
    every step."""

    def __init__(self, checkpoint: LoadedCheckpoint | str, config: EngineConfig, link: StageLink,
                 partition: Sequence[int] | None = None) -> None:
        check_host_tier(config)
        config = replace(config, overlap=False)
        self.config = config
        backend, torch_device, checkpoint = open_checkpoint(checkpoint, config)
        self.checkpoint = checkpoint
        self.link = link
        stage, n_stages = link.stage, link.n_stages
        stages = plan_stage_pools(checkpoint, config, n_stages, partition, torch_device)
        plans, draft = stages.plans, stages.draft
        self.sizing = size_stages(plans, config.budget_bytes, context_len=stages.context,
                                  max_running_requests=config.max_running)
        self.plan = plans[stage]
        self.layers = stages.ranges[stage]
        self.storage = build_kv_storage(self.plan, self.sizing.stages[stage], torch_device, backend=backend)
        self.runner = StageRunner(checkpoint.model, self.plan, stage, stages.ranges, link, relay=draft is not None)
        self.pool = stage_pool(self.storage, self.runner, checkpoint, config, draft, stages.interval)
        self._rid = 0
        self.geometries = link.all_gather(StageGeometry.of_chain(self.storage.allocator, stage))
        self.storage.allocator.install_stage_capacity(self.geometries, stage)
        if config.host_budget is not None:
            enable_stage_host_tier(self.pool, plans, config.host_budget)
        self.digests: list[str] = []

    def generate(self, requests: Sequence[GenerateRequest],
                 progress: Callable[[int, int], None] | None = None) -> GenerateResult:
        """Serve every request; after each step the capacity digest goes to the next stage and the
        previous stage's is checked against this one's."""

        def step_done(done: int, total: int) -> None:
            digest = self.storage.allocator.stage_capacity.take_digest()
            self.digests.append(digest)
            previous = self.link.recv_previous()
            if previous is not None:
                check_stage_agreement(digest, previous, self.link.stage, len(self.digests) - 1)
            self.link.send_next(digest)
            if progress is not None:
                progress(done, total)

        return super().generate(requests, progress=step_done)


def enable_stage_host_tier(pool: ModelPool, plans: Sequence[KVStoragePlan], host_budget: int) -> None:
    """A stage's host tier: its own layers' pages backed up to its own host pools, as many pages per
    sub-pool on every stage (`stage_host_groups`: what the least stage's budget holds), and every
    copy collected in lockstep (`HiCacheController.lockstep`), so what is on the host and what is
    pending are logical state, the same on every stage, and the stages take the same decisions."""
    per_state = host_pages_per_state(pool.plan, pool.checkpoint_interval)
    pool.enable_host_tier(host_budget, max_groups=stage_host_groups(list(plans), host_budget, per_state))
    pool.hicache.lockstep = True


@dataclass(frozen=True)
class StagePlans:
    """What every stage process plans alike, each then keeping its own stage's plan and layers."""

    plans: list[KVStoragePlan]
    ranges: list[range]
    #: the longest sequence (`engine_context`)
    context: int
    draft: DraftSetup | None
    #: every stage's checkpoint interval (`stage_checkpoint_interval`)
    interval: int | None


def plan_stage_pools(checkpoint: LoadedCheckpoint, config: EngineConfig, n_stages: int,
                     partition: Sequence[int] | None, device: torch.device, tp_size: int = 1) -> StagePlans:
    """Every stage's plan (the draft, when configured, loaded onto `device` and fused into each),
    layers, context and checkpoint interval; under tensor parallelism (`tp_size`) each of a rank's
    share of the heads. The one computation every stage process and the check before they start
    make (`check_stage_split`)."""
    whole = engine_plan(checkpoint, config, device, tp_size)  # the one process's plan, cut below
    decls, draft = whole.spec.decls, whole.draft
    n_layers = int(checkpoint.model.config.get_text_config().num_hidden_layers)
    plans = plan_stages(decls, n_stages, page_size=config.page_size, n_layers=n_layers, partition=partition,
                        plan_fn=None if draft is None else stage_draft_planner(draft, config))
    return StagePlans(plans, stage_layer_ranges(n_layers, n_stages, partition), whole.context, draft,
                      stage_checkpoint_interval(decls, config, draft))


def stage_checkpoint_interval(decls: Sequence[KVLayerDecl], config: EngineConfig,
                              draft: DraftSetup | None) -> int | None:
    """The one checkpoint interval every stage keeps (PP-2): the configured one (a draft's), else the
    whole model's default, as one process would keep it (`default_checkpoint_interval`), never a
    stage's own: a stage's plan holds other state and token bytes, so its own default differs, and
    stages on other grids cut other prefill chunks and take other decisions. `decls`: the whole
    model's layers as each process plans them (its shard of the heads under tensor parallelism)."""
    interval = config.checkpoint_interval if draft is None else draft.checkpoint_interval
    if interval is not None:
        return interval
    whole = plan_kv_storage(decls, page_size=config.page_size)
    return default_checkpoint_interval(whole) if whole.state is not None else None


def stage_pool(storage, runner: StageRunner, checkpoint: LoadedCheckpoint, config: EngineConfig,
               draft: DraftSetup | None, interval: int | None) -> ModelPool:
    """A stage's pool, checkpointing every `interval` tokens (`stage_checkpoint_interval`): plain, or
    speculative over the draft fused into its plan, whose verify commits a stage before the last
    receives by relay (LIFE-15)."""
    options = pool_options(config, checkpoint, storage.plan, overlap=False, interval=interval)
    if draft is None:
        return ModelPool(storage, runner, **options)
    if runner.relays_logits:  # a stage before the last: its verify commits are relayed (LIFE-15)
        options["relayed_commit_slots_from_metadata"] = config.relayed_commit_slots_from_metadata
        return speculative_pool(storage, runner, draft, config, options, RelayedSpeculativePool)
    return speculative_pool(storage, runner, draft, config, options)


def stage_draft_planner(draft: DraftSetup, config: EngineConfig) -> Callable[[list[KVLayerDecl]], KVStoragePlan]:
    """Each stage's plan with the whole draft fused into it, numbered after the whole target's
    layers (as `load_draft` numbered the draft model's): every stage runs the draft, so every stage
    holds the same proposals, and every stage's plan has the same sub-pools (PP-5)."""
    draft_decls, offset = draft.decls, draft.offset

    def plan_stage(local: list[KVLayerDecl]) -> KVStoragePlan:
        return plan_with_draft(local, draft_decls, page_size=config.page_size,
                               checkpoint_interval=draft.checkpoint_interval,
                               num_speculative_tokens=config.num_speculative_tokens, draft_offset=offset)

    return plan_stage


@dataclass(frozen=True)
class StageRun:
    """What one stage process reports: the outputs (every stage samples the same), its layers,
    geometry and digests."""

    result: GenerateResult
    first_layer: int
    last_layer: int
    arena_bytes: int
    bytes_per_token: int
    concurrency: int
    digests: list[str]
    #: a stage before the last under speculative decoding: its relayed verify commits, and those
    #: whose state slots a move had changed since the forward's metadata (LIFE-15)
    relayed_commits: int = 0
    relayed_commits_moved: int = 0


def generate_stage_process(stage: int, n_stages: int, port: int, path: str, config: EngineConfig,
                           requests: list[GenerateRequest], partition: tuple[int, ...] | None = None,
                           timeout_s: float = 60.0) -> StageRun:
    """One stage of `kvchain generate --pp N` in its own process."""
    link = StageLink.join(stage, n_stages, port, timeout_s)
    # on an error the group is left as it is: a teardown would wait on the peers, and the process ends
    with StageEngine(path, config, link, partition) as engine:
        result = _by_value(engine.generate(requests))
        geometry = StageGeometry.of_chain(engine.storage.allocator, stage)
        run = StageRun(result, engine.layers.start, engine.layers.stop - 1, engine.storage.sizing.arena_bytes,
                       geometry.bytes_per_token(), engine.sizing.concurrency, engine.digests,
                       getattr(engine.pool, "relayed_commits", 0), getattr(engine.pool, "relayed_commits_moved", 0))
    link.close()
    return run


def _by_value(result: GenerateResult) -> GenerateResult:
    """`result` with its logits as numpy arrays: a tensor crosses processes as a shared-memory
    handle its sender must outlive, and a stage process ends once it reported."""
    result.logits = {k: v.numpy() for k, v in result.logits.items()}
    return result


def _as_tensors(result: GenerateResult) -> GenerateResult:
    result.logits = {k: torch.from_numpy(v) for k, v in result.logits.items()}
    return result


def check_stage_split(checkpoint: LoadedCheckpoint, config: EngineConfig, n_stages: int,
                      partition: Sequence[int] | None = None, tp_size: int = 1) -> list[range]:
    """The stages' layer ranges, or the one-line refusal, before any stage process starts, of a split
    the design refuses (a stage without a full-attention owner, stages whose sub-pools differ, PP-4,
    PP-5) and of what a stage's engine would refuse as it starts (`check_process_plans`: the budget,
    the step's tokens, the host budget). `tp_size`: each stage's ranks (`--tp` with `--pp`)."""
    if config.device != "cpu":
        raise InputError("pipeline stages run on --device cpu (one process per stage over gloo)")
    check_stage_inputs(checkpoint.model)
    n_layers = int(checkpoint.model.config.get_text_config().num_hidden_layers)
    check_stage_blocks(checkpoint.model, stage_layer_ranges(n_layers, n_stages, partition))
    stages = plan_stage_pools(checkpoint, config, n_stages, partition, torch.device("cpu"), tp_size)
    check_process_plans(stages.plans, config, stages.context, stages.interval)
    return stages.ranges


def generate_in_stages(path: str, config: EngineConfig, requests: list[GenerateRequest], n_stages: int,
                       partition: tuple[int, ...] | None = None, *, timeout_s: float = 300.0,
                       env: dict[str, str] | None = None) -> list[StageRun]:
    """Serve `requests` from the checkpoint at `path` split into `n_stages` stage processes over
    gloo on 127.0.0.1; every stage's report, in stage order. A stage that failed raises its error
    (the first stage's to fail) as one line."""
    check_host_tier(config)  # in the parent, before any process starts
    requests = handed_out(path, requests)  # checked and seeded once, here: every process samples alike
    if config.device != "cpu":
        raise InputError("pipeline stages run on --device cpu (one process per stage over gloo)")
    out = run_stage_processes(generate_stage_process, n_stages, (path, config, requests, partition),
                              timeout_s=timeout_s, env=env)
    for stage, status, text in failures(out)[:1]:  # the first to fail: the others failed after it
        raise _stage_error(stage, status, text)
    runs = [out[s][1] for s in range(n_stages)]
    for run in runs:
        _as_tensors(run.result)
    return runs


def _stage_error(stage: int, status: str, text: str, what: str = "stage") -> Exception:
    """A stage's (or rank's) failure as the error the CLI prints: the same class where it is one
    of ours."""
    from .. import errors

    name, _, message = text.partition(": ")
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.KVChainError) and cls is not errors.InvariantError:
        try:
            return cls(f"{what} {stage}: {message}")
        except TypeError:
            pass
    return errors.KVChainError(f"{what} {stage}: {status}: {text}")
