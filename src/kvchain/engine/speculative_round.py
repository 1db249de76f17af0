"""One speculative round's records, and its rollback: the rejected tokens' pages freed.

A round is one decoding request's draft, verify and commit inside a forward. What the host keeps
of it (`Round`) and what the forward stream produces for it (`SpecOutputs`) meet when the forward
is processed; the request's length then becomes what verify kept, and `truncate_rows` frees the
pages past it as any other free (they pend under the forwards in flight). Nothing is ever copied
back: a rollback never undoes a float move."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import InputError
from ..storage import KVStorage
from ..storage_roles import boundary
from .logprobs import log_softmax_rows
from .model_pool import StepOutputs
from .request import ScheduledRequest
from .sampling import sample_rows
from .speculative_state import ForwardStateSlots


@dataclass
class SpecCounters:
    """Speculative rounds verified, draft tokens proposed and accepted, draft forwards run."""

    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    draft_forwards: int = 0
    #: rounds whose request was retracted while they ran: their results are dropped
    dropped: int = 0
    #: decodes that ran plainly because the pool could not hold their round (its scratch slots or pages)
    fallbacks: int = 0


@dataclass
class Round:
    """One request's round in a forward: its row, first position `start`, `k` proposals, the output
    number its first verified token takes, and its virtual scratch state slots."""

    req: ScheduledRequest
    row: int
    start: int
    k: int
    out_index: int
    chain: np.ndarray | None
    round_no: int = -1


@dataclass
class SpecOutputs:
    """What a forward's rounds produce on the forward stream: `tokens[r, i]` the target's greedy
    token after round token i, `accepted[r]` how many proposals it kept."""

    rounds: list[Round]
    tokens: torch.Tensor | None = None
    accepted: torch.Tensor | None = None
    proposed: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    #: `[R, K+1, V]` log-probabilities of every verify position, when a round's request asks
    logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class Acceptance:
    """What acceptance needs beside the logits: `n_plain` plain samples first, then each round's
    `kmax + 1` verify positions (`g_index[r]`, indices into the logits), `valid[r, i]` whether
    proposal i is one of round r's, the rounds' rows (`rows`, batch order), and the logits rows
    sampled rather than argmaxed (`draws`: row, sampling, output index; `sampling.sample_rows`)."""

    n_sample: int
    n_plain: int
    kmax: int
    valid: torch.Tensor
    g_index: torch.Tensor
    rows: np.ndarray
    draws: tuple = ()
    #: whether a round's request asks for log-probabilities (every verify position's are then kept)
    round_logprobs: bool = False


def accept(logits: torch.Tensor, proposed: torch.Tensor | None, outputs: StepOutputs, spec: SpecOutputs,
           how: Acceptance, keep: bool) -> None:
    """The target's tokens and acceptance from a forward's logits: the plain samples' tokens, and
    per round the target's token after each round token (greedy, or drawn as plain decoding draws
    that output: the same seeded draw) and how many proposals it kept (the proposals up to the
    first the target did not choose), so the outputs are plain decoding's."""
    greedy = sample_rows(logits, how.draws) if how.draws else logits.argmax(-1)
    outputs.tokens = greedy[: how.n_plain]
    outputs.logprobs = log_softmax_rows(logits, outputs.lp_rows)
    if keep:
        outputs.logits = logits[: how.n_plain]
    if not spec.rounds:
        return
    target = greedy[how.g_index]  # [R, K+1]
    if proposed is None:
        proposed = target[:, :0]
    match = (proposed == target[:, : how.kmax]) & how.valid
    spec.accepted = torch.cumprod(match.long(), dim=1).sum(dim=1)
    spec.proposed = proposed
    spec.tokens = target
    if how.round_logprobs:
        spec.logprobs = logits[how.g_index].float().log_softmax(-1)
    if keep:
        spec.logits = logits[how.g_index]


@dataclass
class SpecPayload:
    """A speculative forward's payload: its plain samples, its rounds, the state slots it
    resolved at metadata time, and what acceptance needs (`how`). On a pipeline stage before the
    last, acceptance waits for the relay of the last stage's logits: `proposed` keeps the draft's
    proposals until then."""

    outputs: StepOutputs
    spec: SpecOutputs
    slots: ForwardStateSlots | None = None
    held: list[int] = field(default_factory=list)
    how: Acceptance | None = None
    proposed: torch.Tensor | None = None


def chain_slots(storage: KVStorage, rounds: list[Round], kmax: int) -> np.ndarray:
    """The rounds' scratch state slots as physical ids now, `[R, kmax + 1]`: round r's slot after
    round token i (columns past its `k` repeat its last slot and are never written)."""
    state = storage.plan.state.name
    steps = np.arange(kmax + 1)
    return np.stack([storage.physical_pages(state, rd.chain)[np.minimum(steps, rd.k)] for rd in rounds])


def host_tensor(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A host-built index tensor, owned by the forward (not a shared metadata buffer)."""
    t = torch.as_tensor(np.asarray(values), dtype=dtype)
    return t if device.type == "cpu" else t.to(device)


def truncate_rows(storage: KVStorage, rows: np.ndarray, new_lens: np.ndarray) -> int:
    """Shorten rows to `new_lens` (never into a tree-shared prefix): the pages past the new lengths
    are freed as any other free (they pend under a forward in flight). Returns the pages freed.
    Raises `InputError` for rows that are not distinct rows in use, lengths that are not integers
    within a row's own tokens, and `InvariantError` between a launch and its record (LIFE-31);
    either way nothing changed."""
    table = storage.table
    ps = storage.page_size
    rows = boundary.id_array(rows, "truncate_rows rows")
    new_lens = boundary.id_array(new_lens, "truncate_rows lengths")
    boundary.same_count(rows, new_lens, "truncate_rows rows and lengths")
    boundary.in_range(rows, 0, table.rows, "truncate_rows rows")
    boundary.distinct(rows, "truncate_rows rows")
    if not table.active[rows].all():
        raise InputError(f"truncate_rows: rows {rows[~table.active[rows]][:8].tolist()} are not in use")
    old = table.seq_lens[rows].copy()
    if (new_lens > old).any() or (new_lens < table.shared_pages[rows] * ps).any():
        raise InputError(f"truncate to {new_lens.tolist()} from {old.tolist()}: only within a row's own tokens")
    storage.allocator.assert_between_steps("truncate_rows")
    keep = (new_lens + ps - 1) // ps
    have = (old + ps - 1) // ps
    freed = [(row, lo, table.page_table[row, lo:hi].copy())
             for row, lo, hi in zip(rows.tolist(), keep.tolist(), have.tolist()) if hi > lo]
    # shortened first, so the pages past the new lengths are no row's own when they are freed
    table.seq_lens[rows] = new_lens
    for row, lo, pages in freed:
        table.page_table[row, lo:lo + len(pages)] = 0  # the null page, never a freed id another row may take
    if freed:
        try:
            storage.free_virtual_pages(np.concatenate([pages for _row, _lo, pages in freed]))
        except BaseException:  # the free changed nothing: the rows are put back as they were
            table.seq_lens[rows] = old
            for row, lo, pages in freed:
                table.page_table[row, lo:lo + len(pages)] = pages
            raise
    return int(sum(len(pages) for _row, _lo, pages in freed))
