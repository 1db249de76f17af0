"""`kvchain bench spec`: target forwards per generated token with and without a draft, one run.

The same requests (random prompts on a tiny checkpoint, greedy, every request to its
`max_new_tokens`) are served twice through one budget: by the target alone, and with a draft
made from the target's own layers proposing `k` tokens per round. Target forwards per generated
token is the figure speculative decoding lowers (each forward verifies up to `k + 1` tokens per
request); the ratio of the two, and whether the outputs are token-identical, come from one run."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError

DRAFTS = ("first", "whole")


@dataclass(frozen=True)
class ServeFigures:
    """One serving run: target forwards, output tokens, and (with a draft) its rounds."""

    target_forwards: int
    output_tokens: int
    draft_forwards: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.output_tokens if self.output_tokens else 0.0

    def to_dict(self) -> dict:
        return {"target_forwards": self.target_forwards, "output_tokens": self.output_tokens,
                "forwards_per_token": self.forwards_per_token, "draft_forwards": self.draft_forwards,
                "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0}


def spec_summary(plain: ServeFigures, spec: ServeFigures, *, identical: bool, **about: object) -> dict:
    """The bench's JSON: both runs and `ratio`, the speculative run's target forwards per token
    over the plain run's (below 1: the draft saved target forwards)."""
    if plain.output_tokens != spec.output_tokens:
        raise InputError(f"the runs generated {plain.output_tokens} and {spec.output_tokens} tokens: not comparable")
    ratio = spec.forwards_per_token / plain.forwards_per_token if plain.forwards_per_token else 0.0
    return {**about, "plain": plain.to_dict(), "speculative": spec.to_dict(), "ratio": ratio, "identical": identical}


def _figures(result) -> ServeFigures:
    s = result.stats
    return ServeFigures(s.forwards, s.output_tokens, s.draft_forwards, s.spec_proposed, s.spec_accepted)


def run_spec_bench(*, family: str = "qwen3_next", requests: int = 8, k: int = 3, draft: str = "whole",
                   max_new_tokens: int = 24, seed: int = 0, budget: int = 16 * 2**20) -> dict:
    """Serve `requests` prompts with and without the draft (`first`: the target's first and first
    full-attention layer; `whole`: every layer, a draft the target always agrees with)."""
    from ..engine.checkpoint import load_checkpoint
    from ..engine.serve import Engine, EngineConfig, GenerateRequest
    from ..engine.speculative_draft import make_draft_checkpoint
    from ..engine.tiny import make_checkpoint

    if draft not in DRAFTS:
        raise InputError(f"--draft is one of {', '.join(DRAFTS)}, not {draft!r}")
    rng = np.random.default_rng(seed)
    reqs = [GenerateRequest(rng.integers(0, 256, int(rng.integers(8, 40))).tolist(), max_new_tokens)
            for _ in range(requests)]
    with tempfile.TemporaryDirectory(prefix="kvchain-bench-spec-") as tmp:
        target = make_checkpoint(family, Path(tmp) / "target", seed=seed)
        layers = list(range(load_checkpoint(target).config.num_hidden_layers)) if draft == "whole" else None
        draft_dir = make_draft_checkpoint(target, Path(tmp) / "draft", layers)
        base = dict(budget_bytes=budget, page_size=16, context_len=256, ignore_eos=True)
        with Engine(target, EngineConfig(**base)) as engine:
            plain = engine.generate(reqs)
        with Engine(target, EngineConfig(**base, draft_model_path=draft_dir, num_speculative_tokens=k)) as engine:
            spec = engine.generate(reqs)
    identical = [o.token_ids for o in plain.outputs] == [o.token_ids for o in spec.outputs]
    return spec_summary(_figures(plain), _figures(spec), identical=identical, family=family, requests=requests,
                        k=k, draft=draft, max_new_tokens=max_new_tokens)


def render_spec_bench(result: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"bench spec: {result['family']}, {result['requests']} requests, k={result['k']}, "
                  f"{result['draft']} draft", title_justify="left")
    for col in ("run", "target forwards", "output tokens", "forwards / token", "draft forwards", "acceptance"):
        table.add_column(col, justify="right")
    for name in ("plain", "speculative"):
        r = result[name]
        table.add_row(name, str(r["target_forwards"]), str(r["output_tokens"]), f"{r['forwards_per_token']:.3f}",
                      str(r["draft_forwards"]), f"{r['acceptance_rate']:.0%}" if name == "speculative" else "")
    console.print(table)
    console.print(f"ratio (speculative / plain forwards per token): {result['ratio']:.3f}; "
                  f"outputs identical: {result['identical']}")
