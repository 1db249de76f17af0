"""kvchain: one unified KV-cache memory pool for hybrid models.

Every sub-pool (full attention, sliding windows, MLA, recurrent state) lives in one byte arena as a
chain of bands that grow from both ends; pages move to close holes, every admission is priced
exactly, and the pool stays safe when forwards run ahead of the scheduler.

    from kvchain import model_from_preset, plan_kv_storage, size_plan, build_kv_storage
    model = model_from_preset("gpt-oss-120b")
    plan = plan_kv_storage(model.decls, page_size=64)
    sizing = size_plan(plan, 80 * 2**30, context_len=8192)
    storage = build_kv_storage(plan, sizing, "meta")   # or "cpu", "cuda"
"""

from .alloc.chain import ChainAllocator
from .alloc.demand import DEMAND_RULES, DemandPurpose, KVDemand, WindowRetirement, request_demand
from .alloc.iteration_ids import IterationIds
from .alloc.runner_ids import RunnerIds
from .alloc.stage_capacity import StageCapacity, StageGeometry, simulated_snapshot
from .build import build_kv_storage
from .cache.hicache import HiCacheController, HiRadixCache, WritePolicy
from .cache.radix import CheckpointStrategy, UnifiedRadixCache
from .capacity import evict_until_fits, reclaimable_pages
from .decl import (
    MHA,
    MLA,
    FullLifetime,
    KVLayerDecl,
    KVPart,
    State,
    StateLifetime,
    StateTensor,
    WindowLifetime,
    kv_layer_decls,
)
from .device import Device, ImmediateDevice, ModeledDevice, ThreadDevice
from .dist.pd import (
    DecodeNode,
    DecodePreallocQueue,
    DeferredPublishError,
    PendingPublication,
    PrefillNode,
    Received,
    Refused,
    TransferFailed,
)
from .dist.pd_auth import HandshakeRefused, PDListener
from .dist.pd_engine import generate_pd
from .dist.pd_link import PDLink, PeerLost, RankGroup
from .dist.transfer import GlooEngine, NixlEngine, TransferEngine, TransferError, TransferState, make_engine
from .engine import Forward, MetadataUpload, StepResult, StepSequence
from .engine.batch import ForwardBatch
from .engine.checkpoint import LoadedCheckpoint, load_checkpoint
from .engine.model_pool import ModelPool
from .engine.pool import KVChainPool
from .engine.quantize import quantize_checkpoint
from .engine.runner import ModelRunner
from .engine.sampling import SamplingParams
from .engine.scheduler import Scheduler
from .engine.serve import Engine, EngineConfig, GenerateOutput, GenerateRequest, GenerateResult, GenerateStats
from .engine.speculative import SpeculativePool, plan_with_draft, truncate_rows
from .engine.speculative_draft import make_draft, make_draft_checkpoint
from .engine.speculative_state import ForwardStateSlots, commit_states_after_verify
from .engine.tiny import make_checkpoint
from .errors import (
    BudgetError,
    CapacityError,
    DeclarationError,
    EnvVarError,
    InputError,
    InvariantError,
    KVChainError,
    LayoutError,
    PlanError,
    TransferTimeoutError,
)
from .memory.arena import KVArena
from .memory.host import HostPool, HostPools, host_sizing, page_envelope_pair
from .models import list_presets, load_config_file, model_from_config, model_from_preset
from .models.small import small_hybrid
from .plan import (
    KVStoragePlan,
    StagePartitionError,
    SubPool,
    plan_kv_storage,
    plan_stages,
    stage_layer_ranges,
)
from .prefill_budget import Admission, ChainPrefillBudget, Decision, mamba_prefill_chunk_grid
from .sim.baselines import PoolConfig
from .sim.compare import Comparison, SchedulerConfig, compare
from .sim.workloads import load_trace, save_trace, workload_from_name
from .sizing import PipelineSizing, PlanSizing, check_bs1_floor, size_plan, size_stages
from .storage import KVStorage
from .storage_roles import (
    ForwardHooks,
    HostTier,
    Inspection,
    PDTransfers,
    PrefixSharing,
    RowsAndTakes,
    StorageStats,
    Translation,
)
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "DEMAND_RULES",
    "MHA",
    "MLA",
    "Admission",
    "BudgetError",
    "CapacityError",
    "ChainAllocator",
    "ChainPrefillBudget",
    "CheckpointStrategy",
    "Comparison",
    "Decision",
    "DeclarationError",
    "DecodeNode",
    "DecodePreallocQueue",
    "DeferredPublishError",
    "DemandPurpose",
    "Device",
    "Engine",
    "EngineConfig",
    "EnvVarError",
    "Forward",
    "ForwardBatch",
    "ForwardHooks",
    "ForwardStateSlots",
    "FullLifetime",
    "GenerateOutput",
    "GenerateRequest",
    "GenerateResult",
    "GenerateStats",
    "GlooEngine",
    "HandshakeRefused",
    "HiCacheController",
    "HiRadixCache",
    "HostPool",
    "HostPools",
    "HostTier",
    "ImmediateDevice",
    "InputError",
    "Inspection",
    "InvariantError",
    "IterationIds",
    "KVArena",
    "KVChainError",
    "KVChainPool",
    "KVDemand",
    "KVLayerDecl",
    "KVPart",
    "KVStorage",
    "KVStoragePlan",
    "LayoutError",
    "LoadedCheckpoint",
    "MetadataUpload",
    "ModelPool",
    "ModelRunner",
    "ModeledDevice",
    "NixlEngine",
    "PDLink",
    "PDListener",
    "PDTransfers",
    "PeerLost",
    "PendingPublication",
    "PipelineSizing",
    "PlanError",
    "PlanSizing",
    "PoolConfig",
    "PrefillNode",
    "PrefixSharing",
    "RankGroup",
    "Received",
    "Refused",
    "RowsAndTakes",
    "RunnerIds",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SpeculativePool",
    "StageCapacity",
    "StageGeometry",
    "StagePartitionError",
    "State",
    "StateLifetime",
    "StateTensor",
    "StepResult",
    "StepSequence",
    "StorageStats",
    "SubPool",
    "ThreadDevice",
    "TransferEngine",
    "TransferError",
    "TransferFailed",
    "TransferState",
    "TransferTimeoutError",
    "Translation",
    "UnifiedRadixCache",
    "WindowLifetime",
    "WindowRetirement",
    "WritePolicy",
    "build_kv_storage",
    "check_bs1_floor",
    "commit_states_after_verify",
    "compare",
    "evict_until_fits",
    "format_bytes",
    "generate_pd",
    "host_sizing",
    "kv_layer_decls",
    "list_presets",
    "load_checkpoint",
    "load_config_file",
    "load_trace",
    "make_checkpoint",
    "make_draft",
    "make_draft_checkpoint",
    "make_engine",
    "mamba_prefill_chunk_grid",
    "model_from_config",
    "model_from_preset",
    "page_envelope_pair",
    "parse_bytes",
    "plan_kv_storage",
    "plan_stages",
    "plan_with_draft",
    "quantize_checkpoint",
    "reclaimable_pages",
    "request_demand",
    "save_trace",
    "simulated_snapshot",
    "size_plan",
    "size_stages",
    "small_hybrid",
    "stage_layer_ranges",
    "truncate_rows",
    "workload_from_name",
]
