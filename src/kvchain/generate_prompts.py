"""What `kvchain generate` serves: the prompts of its flags or of a JSONL file, each request's
sampling, and a chat rendered by the tokenizer's own template. Everything here is checked before
the checkpoint loads (a bad file costs nothing) and refused as one `InputError` line."""

from __future__ import annotations

import argparse
from pathlib import Path

from . import jsonio
from .errors import InputError

#: a prompts line's sampling fields, which override the flags of the same names
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "seed")
#: every key a prompts line may hold: a misspelt or another API's key (`max_tokens`) is refused,
#: not served with the defaults
LINE_FIELDS = ("prompt_token_ids", "prompt", "messages", "max_new_tokens", *SAMPLING_FIELDS, "logprobs",
               "stop_token_ids")


def read_prompts(args: argparse.Namespace) -> list[tuple[list[int] | None, str | list[dict] | None, int, dict]]:
    """(token ids or None, text or a chat's messages or None, max_new_tokens, the line's sampling
    fields) per request, in input order."""
    if args.prompt:
        return [(None, text, args.max_new_tokens, {}) for text in args.prompt]
    path = Path(args.prompts)
    if not args.prompts:
        raise InputError("--prompts: an empty path")
    text = jsonio.read_text(path, f"--prompts {path}")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"--prompts {path}, line {n}"
        obj = jsonio.loads(line, where)
        if not isinstance(obj, dict):
            raise InputError(f"{where}: a request is a JSON object, got {type(obj).__name__}")
        max_new = obj.get("max_new_tokens", args.max_new_tokens)
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
            raise InputError(f"{where}: max_new_tokens must be a positive integer, got {max_new!r}")
        given = [key for key in ("prompt_token_ids", "prompt", "messages") if key in obj]
        unknown = [key for key in obj if key not in LINE_FIELDS]
        if unknown and given:
            raise InputError(f"{where}: unknown field {unknown[0]!r} (a request line takes {', '.join(LINE_FIELDS)})")
        if len(given) > 1:
            raise InputError(f'{where}: give one of "prompt_token_ids", "prompt" and "messages", not {given}')
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise InputError(f"{where}: prompt_token_ids must be a non-empty list of integers")
            out.append((ids, None, max_new, _sampling_fields(obj, where)))
        elif isinstance(obj.get("prompt"), str):
            out.append((None, obj["prompt"], max_new, _sampling_fields(obj, where)))
        elif "messages" in obj:
            out.append((None, _messages(obj["messages"], where), max_new, _sampling_fields(obj, where)))
        else:
            raise InputError(f'{where}: needs "prompt_token_ids" (a list), "prompt" (a string) or "messages" '
                             "(a list of chat messages)")
    if not out:
        raise InputError(f"--prompts {path}: no requests in the file")
    return out


def _sampling_fields(obj: dict, where: str) -> dict:
    """A prompts line's own sampling fields, checked as a whole `SamplingParams` would check them,
    and its `stop_token_ids` (a list of integers; the vocabulary checks them once the model loads)."""
    from .engine.sampling import SamplingParams

    fields = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    try:
        SamplingParams(**{"temperature": 1.0, **fields})
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    if "logprobs" in obj:
        lp = obj["logprobs"]
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or lp < 0):
            raise InputError(f"{where}: logprobs must be a non-negative integer or null, got {lp!r}")
        fields["logprobs"] = lp
    if "stop_token_ids" in obj:
        stop = obj["stop_token_ids"]
        if not isinstance(stop, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop):
            raise InputError(f"{where}: stop_token_ids must be a list of integers, got {stop!r}")
        fields["stop_token_ids"] = stop
    return fields


def request_stops(args: argparse.Namespace, fields: dict) -> list[int]:
    """A request's own stop token ids: its prompts line's, else `--stop-token-ids`."""
    return fields.get("stop_token_ids", args.stop_token_ids)


def request_logprobs(args: argparse.Namespace, fields: dict) -> int | None:
    """How many alternatives a request reports with each token's log-probability: its prompts
    line's `logprobs`, else `--logprobs` (None: no log-probabilities)."""
    return fields.get("logprobs", args.logprobs)


def request_sampling(args: argparse.Namespace, i: int, fields: dict):
    """Request `i`'s sampling: the flags, a prompts line's fields over them; `--seed` seeds request
    i with SEED + i, so that identical prompts sample independently."""
    from .engine.sampling import SEED_LIMIT, SamplingParams

    seed = None if args.seed is None else (args.seed + i) % SEED_LIMIT
    own = {k: v for k, v in fields.items() if k in SAMPLING_FIELDS}
    return SamplingParams(**{"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                             "seed": seed, **own})


def _messages(messages: object, where: str) -> list[dict]:
    """A chat: a non-empty list of {"role": str, "content": str} objects."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InputError(f'{where}: messages must be a non-empty list of {{"role": "...", "content": "..."}} objects')
    return messages


def encode_prompt(tokenizer, prompt: str | list[dict], chat: bool) -> list[int]:
    """A text prompt's token ids, or (a chat's messages, or a text under `chat`) the ids of the
    conversation as the tokenizer's chat template renders it, with the assistant's turn opened;
    the template writes its own special tokens, so none are added to it."""
    if isinstance(prompt, str) and not chat:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if not ids:
            raise InputError(f"the prompt {prompt!r} encodes to no tokens")
        return ids
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("a chat (--chat, or messages in --prompts) needs a chat template in the checkpoint's "
                         "tokenizer, which has none")
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:  # the checkpoint's own template
        raise InputError(f"the tokenizer's chat template failed on {messages!r}: {type(e).__name__}: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]
