"""Log-probabilities of the tokens a request generates, as serving APIs return them.

Each is read from the model's own distribution at that output (the log-softmax of its logits,
before temperature, top-k or top-p), for the token chosen and the `n` likeliest: computed on the
forward stream for the rows of requests that ask (`rows`), turned into plain numbers on the host
when the forward is processed."""

from __future__ import annotations

import torch

#: the most alternatives a request may ask for per token
MAX_LOGPROBS = 20


def log_softmax_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """The log-probabilities `[len(rows), V]` of the logits rows of requests that ask for them."""
    if not rows:
        return None
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return logits.index_select(0, index).float().log_softmax(-1)


def token_logprobs(logprobs: torch.Tensor, token: int, n: int) -> dict:
    """One output's entry: the chosen token's log-probability and the `n` likeliest tokens'."""
    row = logprobs.cpu()
    values, ids = row.topk(n) if n else (row[:0], row[:0].long())
    return {"token_id": int(token), "logprob": float(row[token]),
            "top": [[int(i), float(v)] for v, i in zip(values.tolist(), ids.tolist())]}
