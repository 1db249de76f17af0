"""`kvchain generate` and `kvchain make-checkpoint`: serve a Hugging Face checkpoint through one
kvchain pool, greedy, and write a tiny random checkpoint to try it on with no download."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .cli_common import byte_size, dump_json, output_console, positive_int, progress, say, seed_int
from .errors import InputError
from .generate_prompts import encode_prompt, read_prompts, request_logprobs, request_sampling, request_stops


def configure_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", required=True, help="a checkpoint directory: config.json and *.safetensors")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", nargs="+", action="extend",
                     help="one or more prompts as text (needs a tokenizer in the directory); the flag may repeat")
    src.add_argument("--prompts", help='a JSONL file: one request a line, {"prompt_token_ids": [...]}, '
                     '{"prompt": "text"} or {"messages": [{"role": ..., "content": ...}, ...]} (a chat), each with '
                     'an optional "max_new_tokens"')
    p.add_argument("--chat", action="store_true",
                   help="send each text prompt as a user message through the tokenizer's chat template")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy); a prompts line's \"temperature\" overrides it")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the most likely tokens whose probabilities sum to p (default 1: all)")
    p.add_argument("--seed", type=seed_int, default=None,
                   help="seed of the sampling: request i is seeded SEED + i (default: drawn at random); a "
                        "prompts line's \"seed\" overrides it")
    p.add_argument("--max-new-tokens", type=positive_int, default=16,
                   help="new tokens per request where the request names none (default 16)")
    p.add_argument("--budget", type=byte_size, default=64 * 2**20,
                   help="bytes for the KV pool, fixed tables included (default 64MiB)")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (default 16)")
    p.add_argument("--context", type=positive_int, default=None,
                   help="the longest sequence (default: the model's, at most 4096)")
    p.add_argument("--max-running", type=positive_int, default=64, help="requests in one batch (default 64)")
    p.add_argument("--max-batched-tokens", type=positive_int, default=1024,
                   help="tokens per forward, decodes and prefill chunks (default 1024)")
    p.add_argument("--checkpoint-interval", type=positive_int, default=None,
                   help="tokens between recurrent-state checkpoints (models with state; default: the plan's)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="launch forward N+1 before processing forward N (default on)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse cached prefixes: attention, window rows, state checkpoints (default on)")
    p.add_argument("--host-budget", type=byte_size, default=None,
                   help="bytes of host memory for the host tier: prefixes the pool evicts are copied there "
                        "and loaded back on a match (default: no host tier)")
    p.add_argument("--ignore-eos", action="store_true", help="run every request to its max_new_tokens")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model and the pool live")
    p.add_argument("--stop-token-ids", type=_token_ids, default=[], metavar="ID,ID,...",
                   help="token ids that end a request besides the model's end of sequence (--ignore-eos leaves "
                        "them on); a prompts line's \"stop_token_ids\" overrides them")
    p.add_argument("--logprobs", type=_logprobs, default=None,
                   metavar="N", help="report each output token's log-probability and its N likeliest alternatives "
                                     "(in --json); a prompts line's \"logprobs\" overrides it")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="what the model computes in (default auto: the checkpoint's own)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16", "float32"],
                   help="what the pool keeps K/V in (default auto: --dtype's; fp8: e4m3, saturating, no scale)")
    p.add_argument("--pd", action="store_true",
                   help="serve with a prefill process and a decode process on this machine (loopback): the prefill "
                   "hands each request's KV, window rows and state to the decode (docs/pd.md); the prefill keeps the "
                   "prefix cache, the decode none")
    p.add_argument("--pd-engine", choices=("nixl", "gloo"), default=None,
                   help="--pd's data plane (default nixl where it imports, else gloo)")
    p.add_argument("--json", action="store_true",
                   help='print {"outputs": [{"index", "token_ids", ...}], "stats": {...}} instead of tables')
    p.add_argument("--draft-model-path", default=None,
                   help="speculative decoding: a draft checkpoint sharing the model's vocabulary "
                        "(`kvchain make-checkpoint ... --draft DIR` writes one)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=None,
                   help="tokens the draft proposes per round (with --draft-model-path)")
    p.add_argument("--pp", type=positive_int, default=1,
                   help="pipeline stages: split the layers across this many processes over gloo, each stage its own "
                        "pool of its own layers (cpu; default 1)")
    p.add_argument("--pp-partition", type=_layer_counts, default=None,
                   help="layers per stage with --pp, comma separated (default: an even split, as engines do)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: split the heads and the MLP across this many processes over gloo, "
                        "each rank a pool of its shard of the KV and state heads (cpu; default 1)")


def _layer_counts(text: str) -> tuple[int, ...]:
    """Layers per pipeline stage, such as `2,2`."""
    return tuple(positive_int(part) for part in text.split(","))


def _check_requests(args: argparse.Namespace, checkpoint, requests: list) -> None:
    """What the checkpoint alone says about the flags and prompts, before any process starts: a
    context past the model's, state flags for a model without state, ids outside the vocabulary,
    and a prompt the context can never hold."""
    from .cli_common import check_context, has_state
    from .engine.serve import checked_prompt, engine_context

    spec = checkpoint.model_spec()
    check_context(spec, args.context)
    if args.checkpoint_interval is not None and not has_state(spec):
        raise InputError(f"--checkpoint-interval: {args.model_path} has no recurrent state")
    vocab = int(checkpoint.model.get_input_embeddings().num_embeddings)
    context = engine_context(args.context, spec)
    for i, req in enumerate(requests):
        n = len(checked_prompt(i, req, vocab))
        if n >= context:
            larger = "a larger --context or " if context < spec.max_context else ""
            raise InputError(f"request {i}: its {n} prompt tokens reach the context length {context}"
                             f"{'' if larger else ' (the model maximum)'}; give {larger}a shorter prompt")


def run_generate(args: argparse.Namespace) -> int:
    from .engine.checkpoint import load_checkpoint
    from .engine.serve import Engine, EngineConfig, GenerateRequest

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError("--device cuda: CUDA is not available on this machine")
    if args.pd_engine is not None and not args.pd:
        raise InputError("--pd-engine chooses --pd's data plane; --pd is not given")
    parsed = read_prompts(args)  # before the checkpoint loads: a bad file costs nothing
    request_sampling(args, 0, {})  # the flags too
    checkpoint = load_checkpoint(args.model_path, device=args.device, dtype=args.dtype)
    tokenizer = checkpoint.tokenizer
    if args.prompt and tokenizer is None:
        raise InputError(f"--prompt needs a tokenizer in {args.model_path}; give --prompts with prompt_token_ids")
    if tokenizer is None and any(ids is None for ids, _t, _m, _s in parsed):
        raise InputError(f"--prompts {args.prompts}: text prompts need a tokenizer in {args.model_path}")
    requests = []
    for i, (ids, text, max_new, fields) in enumerate(parsed):
        if ids is None:
            ids = encode_prompt(tokenizer, text, args.chat)
        requests.append(GenerateRequest(ids, max_new, request_sampling(args, i, fields), request_stops(args, fields),
                                        request_logprobs(args, fields)))
    _check_requests(args, checkpoint, requests)
    config = EngineConfig(budget_bytes=args.budget, page_size=args.page_size, context_len=args.context,
                          max_running=args.max_running, max_batched_tokens=args.max_batched_tokens,
                          overlap=args.overlap, device=args.device, prefix_cache=args.prefix_cache,
                          checkpoint_interval=args.checkpoint_interval, ignore_eos=args.ignore_eos,
                          host_budget=args.host_budget, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          **_speculative(args))
    split = args.tp > 1 or args.pp > 1 or args.pp_partition is not None
    if split and args.pd:
        raise InputError("--pd does not combine with --tp/--pp")
    if args.pd:
        return _run_pd(args, checkpoint, config, requests, tokenizer)
    if args.tp > 1 and (args.pp > 1 or args.pp_partition is not None):
        return _run_grid(args, checkpoint, config, requests)
    if args.tp > 1:
        return _run_ranks(args, checkpoint, config, requests)
    if args.pp > 1 or args.pp_partition is not None:
        return _run_stages(args, checkpoint, config, requests)
    with Engine(checkpoint, config) as engine, progress(disable=args.json, unit="requests") as bar:
        task = bar.add_task("generate", total=len(requests))
        result = engine.generate(requests, progress=lambda done, total: bar.update(task, completed=done))
    return _report(args, result, tokenizer, engine.storage.sizing.budget_bytes)


def _run_pd(args: argparse.Namespace, checkpoint, config, requests, tokenizer) -> int:
    from .dist.pd_engine import generate_pd
    from .dist.transfer import nixl_available
    from .engine.serve import check_engine_start

    if args.device != "cpu":
        raise InputError("--pd runs on --device cpu")
    kind = args.pd_engine or ("nixl" if nixl_available() is None else "gloo")
    if kind == "nixl" and nixl_available() is not None:
        raise InputError(f"--pd-engine nixl: {nixl_available()}")
    check_engine_start(checkpoint, config)  # what each node's engine refuses, before either starts
    result = generate_pd(args.model_path, config, requests, kind=kind)
    return _report(args, result, tokenizer, args.budget, (), " on the prefill node")


def _run_stages(args: argparse.Namespace, checkpoint, config, requests) -> int:
    """`--pp N`: one process per stage (`dist/pp_engine.py`); every stage samples the same tokens."""
    from .dist.pp_engine import check_stage_split, generate_in_stages

    if args.device != "cpu":
        raise InputError(f"--pp {args.pp}: pipeline stages run on --device cpu (one process per stage over gloo)")
    check_stage_split(checkpoint, config, args.pp, args.pp_partition)
    tokenizer = checkpoint.tokenizer
    runs = generate_in_stages(args.model_path, config, requests, args.pp, args.pp_partition)
    result = runs[-1].result
    stages = [{"stage": i, "first_layer": r.first_layer, "last_layer": r.last_layer, "arena_bytes": r.arena_bytes,
               "bytes_per_token": r.bytes_per_token, "steps_checked": len(r.digests),
               "relayed_commits": r.relayed_commits, "relayed_commits_moved": r.relayed_commits_moved}
              for i, r in enumerate(runs)]
    lines = [f"stage {s['stage']}: layers {s['first_layer']}..{s['last_layer']}, arena {s['arena_bytes']:,} B, "
             f"{s['bytes_per_token']:,} B/token, capacity digest exchanged after {s['steps_checked']} steps"
             + (f", {s['relayed_commits']} relayed verify commits ({s['relayed_commits_moved']} after a move)"
                if s["relayed_commits"] else "")
             for s in stages]
    return _report(args, result, tokenizer, config.budget_bytes, lines, " on the last stage", stages=stages)


def _run_grid(args: argparse.Namespace, checkpoint, config, requests) -> int:
    """`--tp N --pp M`: one process per stage and rank (`dist/tp_pp_engine.py`); all sample the same."""
    from .dist.tp_pp_engine import check_grid_split, generate_in_grid

    if args.device != "cpu":
        raise InputError(f"--tp {args.tp} --pp {args.pp}: ranks and stages run on --device cpu (one process each "
                         "over gloo)")
    if args.pp < 2:
        raise InputError(f"--pp-partition with --tp {args.tp}: give --pp 2 or more")
    check_grid_split(checkpoint, config, args.tp, args.pp, args.pp_partition)
    runs = generate_in_grid(args.model_path, config, requests, args.tp, args.pp, args.pp_partition)
    result = runs[0].result
    grid = [{"stage": r.stage, "rank": r.rank, "first_layer": r.first_layer, "last_layer": r.last_layer,
             "arena_bytes": r.arena_bytes, "bytes_per_token": r.bytes_per_token,
             "steps_checked": len(r.stage_digests)} for r in runs]
    lines = [f"stage {g['stage']} rank {g['rank']}: layers {g['first_layer']}..{g['last_layer']}, arena "
             f"{g['arena_bytes']:,} B, {g['bytes_per_token']:,} B/token, capacity and decision digests compared "
             f"after {g['steps_checked']} steps" for g in grid]
    return _report(args, result, checkpoint.tokenizer, config.budget_bytes, lines, " on stage 0, rank 0", processes=grid)


def _run_ranks(args: argparse.Namespace, checkpoint, config, requests) -> int:
    """`--tp N`: one process per rank (`dist/tp_engine.py`); every rank samples the same tokens."""
    from .dist.tp_engine import check_tp_split, generate_in_ranks

    if args.device != "cpu":
        raise InputError(f"--tp {args.tp}: tensor-parallel ranks run on --device cpu (one process per rank over gloo)")
    check_tp_split(checkpoint, config, args.tp)
    runs = generate_in_ranks(args.model_path, config, requests, args.tp)
    result = runs[0].result
    ranks = [{"rank": i, "arena_bytes": r.arena_bytes, "bytes_per_token": r.bytes_per_token,
              "steps_checked": len(r.digests)} for i, r in enumerate(runs)]
    lines = [f"rank {r['rank']}: arena {r['arena_bytes']:,} B, {r['bytes_per_token']:,} B/token (its shard of the "
             f"KV heads), decision digests compared after {r['steps_checked']} steps" for r in ranks]
    return _report(args, result, checkpoint.tokenizer, config.budget_bytes, lines, " on each rank", ranks=ranks)


def _speculative(args: argparse.Namespace) -> dict:
    """The draft flags as `EngineConfig` fields; one without the other is refused."""
    if (args.draft_model_path is None) != (args.num_speculative_tokens is None):
        raise InputError("--draft-model-path and --num-speculative-tokens go together")
    if args.draft_model_path is None:
        return {}
    return {"draft_model_path": args.draft_model_path, "num_speculative_tokens": args.num_speculative_tokens}


def _report(args: argparse.Namespace, result, tokenizer, budget_bytes: int, lines: Sequence[str] = (),
            host_where: str = "", **processes) -> int:
    """Print a run: with `--json` its outputs, stats and each process's figures (under their key in
    `processes`), else the rendered table and one line a process. `host_where` says whose host
    pools the host tier's bytes are, on a split run."""
    if args.json:
        print(dump_json({"outputs": [o.to_dict() for o in result.outputs], "stats": result.stats.to_dict(),
                         **processes}))
        return 0
    _render(result, tokenizer, budget_bytes, host_where)
    for line in lines:
        say(line)
    return 0


def _render(result, tokenizer, budget_bytes: int, host_where: str = "") -> None:
    from rich.table import Table

    console = output_console()
    outputs = Table(title="kvchain generate", title_justify="left")
    outputs.add_column("#", justify="right")
    outputs.add_column("new tokens", justify="right")
    outputs.add_column("stop")
    outputs.add_column("output", overflow="fold")  # the whole text, wrapped: never cut
    for o in result.outputs:
        text = tokenizer.decode(o.token_ids) if tokenizer is not None else " ".join(map(str, o.token_ids))
        outputs.add_row(str(o.index), str(len(o.token_ids)), o.finish_reason + (f" ({o.reason})" if o.reason else ""),
                        repr(text)[1:-1])
    console.print(outputs)
    s = result.stats
    table = Table(show_header=False, title="run", title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("throughput", f"{s.tokens_per_second:,.1f} output tokens/s ({s.output_tokens} in {s.seconds:.2f} s)"),
        ("steps", f"{s.steps} ({s.forwards} forwards)"),
        ("running requests (peak)", str(s.peak_running)),
        ("prefix hits", f"{s.cached_tokens} of {s.prompt_tokens} prompt tokens ({s.prefix_hit_rate:.0%})"),
        ("compaction moves", str(s.compaction_moves)),
        ("window pages retired", str(s.window_pages_retired)),
        ("state checkpoints", str(s.checkpoints)),
        ("pool utilisation (peak)", f"{s.peak_utilisation * 100:.2g}% of {budget_bytes:,} bytes"),
    ]
    if s.host_bytes:
        rows.append(("host tier", f"{s.host_hits} hits, {s.host_backups} backups, {s.host_loads} loads "
                                  f"({s.host_bytes:,} host bytes{host_where})"))
    if s.spec_rounds:
        rows += [("speculative acceptance", f"{s.acceptance_rate:.0%} ({s.spec_accepted} of {s.spec_proposed} "
                                            f"proposed tokens, {s.spec_rounds} rounds)"),
                 ("tokens per target forward", f"{s.tokens_per_target_forward:.2f} ({s.draft_forwards} draft forwards)")]
    for label, value in rows:
        table.add_row(label, value)
    console.print(table)


def _logprobs(text: str) -> int:
    from .engine.logprobs import MAX_LOGPROBS

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer, not {text!r}") from None
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(f"alternatives per token lie in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids like 2,7, not {text!r}") from None
    if any(t < 0 for t in ids):
        raise argparse.ArgumentTypeError(f"token ids are non-negative, not {text!r}")
    return ids


def configure_make_checkpoint(p: argparse.ArgumentParser) -> None:
    from .engine.tiny import FAMILIES

    p.add_argument("family", help=f"one of {', '.join(FAMILIES)}")
    p.add_argument("dir", help="the directory to write (config.json, model.safetensors, tokenizer)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--force", action="store_true", help="write into a directory that already holds a checkpoint")
    p.add_argument("--draft", default=None, metavar="DIR",
                   help="also write a matching draft for speculative decoding: the model's own first layers")
    p.add_argument("--draft-layers", default=None, metavar="I,J,...",
                   help="the layers the draft keeps (default: the first and the first full-attention layer)")
    p.add_argument("--quantize", choices=("fp8", "mxfp4", "compressed-fp8", "compressed-int8"), default=None,
                   help="store the weights as a quantised release does: fp8 blocks (DeepSeek-V3's layout), "
                        "MXFP4 experts (GPT-OSS's) or compressed-tensors per-channel fp8 or int8 (llm-compressor's "
                        "FP8-dynamic and W8A8); the loader dequantises them")
    p.add_argument("--fp8-block", type=positive_int, default=None,
                   help="rows and columns of an fp8 block (default 128; with --quantize fp8)")


def _checkpoint_dir(path: str, flag: str, force: bool) -> Path:
    """A folder a checkpoint may be written to: not a file, not an empty path, and not one that
    holds a checkpoint already unless `force`."""
    if not path:
        raise InputError(f"{flag}: an empty path")
    try:
        path.encode("utf-8")  # the tokenizer's writer takes UTF-8 paths only
    except UnicodeEncodeError:
        raise InputError(f"{flag} {path!r}: not a UTF-8 path") from None
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} exists and is not a directory")
    if (out / "config.json").exists() and not force:
        raise InputError(f"{out} already holds a checkpoint (give --force to overwrite it)")
    return out


def _draft_layers(args: argparse.Namespace, num_layers: int) -> list[int] | None:
    if args.draft_layers is None:
        return None
    if args.draft is None:
        raise InputError("--draft-layers chooses the layers of --draft, which is not given")
    try:
        layers = [int(x) for x in args.draft_layers.split(",")]
    except ValueError:
        raise InputError(f"--draft-layers takes layer indices like 0,3, not {args.draft_layers!r}") from None
    if layers != sorted(set(layers)) or not all(0 <= i < num_layers for i in layers):
        raise InputError(f"--draft-layers: increasing layer indices of the target's {num_layers} layers, "
                         f"got {args.draft_layers!r}")
    return layers


def _write_checkpoint(args: argparse.Namespace, out: Path) -> None:
    """The family's tiny checkpoint at `out`, quantised with `--quantize`: written and quantised in a
    scratch folder first, so that a family with nothing to quantise leaves nothing behind."""
    from .engine.tiny import make_checkpoint

    if args.quantize is None:
        make_checkpoint(args.family, out, seed=args.seed)
        return
    import shutil
    import tempfile

    from .engine.quantize import quantize_checkpoint

    with tempfile.TemporaryDirectory(prefix="kvchain-checkpoint-") as scratch:
        made = make_checkpoint(args.family, Path(scratch) / "checkpoint", seed=args.seed)
        quantize_checkpoint(made, args.quantize, args.fp8_block or 128)
        shutil.copytree(made, out, dirs_exist_ok=True)


def run_make_checkpoint(args: argparse.Namespace) -> int:
    from .engine.tiny import FAMILIES, tiny_config

    if args.family not in FAMILIES:
        raise InputError(f"unknown family {args.family!r}; known: {', '.join(FAMILIES)}")
    # every argument is checked before anything is written: a refusal leaves no checkpoint behind
    out = _checkpoint_dir(args.dir, "DIR", args.force)
    draft = _checkpoint_dir(args.draft, "--draft", args.force) if args.draft is not None else None
    if draft is not None and draft.resolve() == out.resolve():
        raise InputError(f"--draft {draft} is the target's own folder")
    layers = _draft_layers(args, tiny_config(args.family).num_hidden_layers)
    if args.fp8_block is not None and args.quantize != "fp8":
        raise InputError("--fp8-block sizes the blocks of --quantize fp8, which is not given")
    try:
        _write_checkpoint(args, out)
    except OSError as e:
        raise InputError(f"cannot write {out}: {e.strerror or e}") from None
    stored = "" if args.quantize is None else f", its weights stored {args.quantize},"
    print(f"wrote a tiny {args.family} checkpoint{stored} to {out}")
    if draft is not None:
        from .engine.speculative_draft import make_draft_checkpoint

        try:
            make_draft_checkpoint(out, draft, layers)
        except OSError as e:
            raise InputError(f"cannot write {draft}: {e.strerror or e}") from None
        print(f"wrote its draft to {draft}")
    return 0
