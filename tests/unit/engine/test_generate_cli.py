"""`kvchain make-checkpoint` and `kvchain generate` as a new user runs them: a tiny checkpoint
written, then served from a prompts file and from text; bad input is one line and exit code 2."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import GenerationConfig

from kvchain.cli import main
from kvchain.cli_common import SCHEMA_VERSION
from kvchain.engine.checkpoint import load_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "gpt_oss"
    assert main(["make-checkpoint", "gpt_oss", str(path)]) == 0
    return path


def _greedy(path, ids: list[int], n: int) -> list[int]:
    model = load_checkpoint(path).model
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=GenerationConfig(
        max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0))
    return out[0, len(ids):].tolist()


def test_generate_json_from_a_prompts_file(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt_token_ids": [5, 6, 7, 8, 9], "max_new_tokens": 5}, {"prompt": "hello kvchain"}, {}]
    prompts.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    capsys.readouterr()
    assert main(["generate", "--model-path", str(tiny), "--prompts", str(prompts), "--max-new-tokens", "7",
                 "--budget", "4MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["index"] for o in out["outputs"]] == [0, 1]
    assert out["outputs"][0]["token_ids"] == _greedy(tiny, [5, 6, 7, 8, 9], 5)
    assert out["outputs"][1]["token_ids"] == _greedy(tiny, list(b"hello kvchain"), 7)
    assert out["stats"]["output_tokens"] == 12 and out["stats"]["tokens_per_second"] > 0
    assert out["schema_version"] == SCHEMA_VERSION
    # no draft, so speculative decoding's figures do not exist (not 0.0, nor the batch's tokens per forward)
    assert out["stats"]["acceptance_rate"] is None and out["stats"]["tokens_per_target_forward"] is None


def test_generate_text_prints_tables(tiny, capsys):
    assert main(["generate", "--model-path", str(tiny), "--prompt", "abc", "--max-new-tokens", "3",
                 "--budget", "4MiB", "--no-overlap"]) == 0
    text = capsys.readouterr().out
    assert "throughput" in text and "prefix hits" in text and "compaction moves" in text
    # a small pool use is a figure, not "0%"
    assert re.search(r"pool utilisation \(peak\) +│ +0\.\d+% of 4,194,304 bytes", text), text


def test_generate_prints_each_output_whole(tiny, monkeypatch):
    """A long output wraps in its cell; none is cut with an ellipsis."""
    from support.output import narrow_console

    console = narrow_console()
    monkeypatch.setattr("kvchain.generate_cli.output_console", lambda: console)
    assert main(["generate", "--model-path", str(tiny), "--prompt", "a", "b", "--max-new-tokens", "60",
                 "--budget", "4MiB", "--ignore-eos"]) == 0
    table = [line for line in console.export_text().splitlines() if line[:1] in "┏┃┡│└┌"]
    assert table and not any("…" in line or len(line) > 100 for line in table), "\n".join(table)


def test_a_repeated_prompt_flag_adds_prompts(tiny, capsys):
    """`--prompt A --prompt B C` serves all three, in order (a repeated flag once kept only its last)."""
    assert main(["generate", "--model-path", str(tiny), "--prompt", "ab", "--prompt", "cd", "efg",
                 "--max-new-tokens", "2", "--budget", "4MiB", "--json"]) == 0
    outputs = json.loads(capsys.readouterr().out)["outputs"]
    assert [o["token_ids"] for o in outputs] == [_greedy(tiny, list(p), 2) for p in (b"ab", b"cd", b"efg")]


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "invalid JSON"),
    ('{"prompt_token_ids": [' + "9" * 5000 + "]}", "invalid JSON"),
    ('{"prompt_token_ids": [100000000000000000000000]}', "token ids must lie in [0, 256)"),
    # at the model's own maximum, no larger --context is offered (the flag would be refused)
    ('{"prompt_token_ids": [' + ", ".join(["1"] * 600) + "]}", "(the model maximum); give a shorter prompt"),
    ('{"prompt_token_ids": [1], "prompt": "hi"}', 'give one of "prompt_token_ids", "prompt" and "messages"'),
    ('{"messages": "hi"}', "messages must be a non-empty list"),
    ('{"messages": [{"role": "user"}]}', "messages must be a non-empty list"),
    # the tiny checkpoint's tokenizer has no chat template
    ('{"messages": [{"role": "user", "content": "hi"}]}', "needs a chat template in the checkpoint's tokenizer"),
    ("[1, 2]", "a request is a JSON object"),
    ('{"prompt_token_ids": []}', "non-empty list"),
    ('{"prompt_token_ids": [1, 999]}', "token ids must lie in [0, 256)"),
    ('{"prompt_token_ids": [1], "max_new_tokens": 0}', "max_new_tokens must be a positive integer"),
    ('{"text": "x"}', 'needs "prompt_token_ids"'),
    # another API's name for a field was served with the default, silently
    ('{"prompt_token_ids": [1], "max_tokens": 5}', "unknown field 'max_tokens' (a request line takes"),
    ('{"prompt_token_ids": [1], "temprature": 0.5}', "unknown field 'temprature'"),
])
def test_bad_prompts_are_one_line_and_exit_2(tiny, tmp_path, capsys, line, message):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(line + "\n")
    assert main(["generate", "--model-path", str(tiny), "--prompts", str(prompts), "--budget", "4MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


#: a chat template of the usual shape: each turn tagged with its role, the assistant's turn opened
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_tiny(tiny, tmp_path_factory):
    """The tiny checkpoint with a chat template in its tokenizer, as instruct releases ship one."""
    import shutil

    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chat") / "gpt_oss"
    shutil.copytree(tiny, path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def test_a_chat_goes_through_the_tokenizer_s_template(chat_tiny, tmp_path, capsys):
    """`--chat` sends each text as a user message, a prompts line may hold the messages of a chat;
    either is served as the template's rendering, the assistant's turn opened (no special token
    added beside the template's own)."""
    rendered = list(b"<|user|>hi there\n<|assistant|>")
    chat = list(b"<|system|>be brief\n<|user|>hi there\n<|assistant|>")
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"},
                                                {"role": "user", "content": "hi there"}]}) + "\n")
    base = ["generate", "--model-path", str(chat_tiny), "--max-new-tokens", "4", "--budget", "4MiB", "--json"]
    capsys.readouterr()
    assert main([*base, "--prompt", "hi there", "--chat"]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"] == _greedy(chat_tiny, rendered, 4)
    assert main([*base, "--prompts", str(prompts)]) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"] == _greedy(chat_tiny, chat, 4)
    assert main([*base, "--prompt", "hi there"]) == 0  # without --chat: the text as it is
    assert json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"] == _greedy(chat_tiny, list(b"hi there"), 4)


def test_chat_without_a_template_is_one_line_and_exit_2(tiny, capsys):
    assert main(["generate", "--model-path", str(tiny), "--prompt", "hi", "--chat", "--budget", "4MiB"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a chat template" in err


def test_bad_bytes_flags_and_budgets_exit_2(tiny, tmp_path, capsys):
    """A prompts file that is not UTF-8, state flags for a model without state, a context past the
    model's, a budget no machine can allocate: one line each, before or instead of the run."""
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"prompt_token_ids": [1]}\n\xff\xfe\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    for argv, needle in (
            (["--prompts", str(binary)], "not UTF-8"),
            (["--prompts", str(tmp_path)], "is a folder"),
            (["--prompts", str(good), "--checkpoint-interval", "4"], "no recurrent state"),
            (["--prompts", str(good), "--context", "100000000"], "maximum context"),
            # refused by the pool's page limit before any allocation is tried
            (["--prompts", str(good), "--budget", "512TiB"], "would span")):
        capsys.readouterr()
        assert main(["generate", "--model-path", str(tiny), *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, (argv, err)


def test_an_output_past_the_context_is_clipped_not_allocated(tiny, tmp_path, capsys):
    """`--max-new-tokens` far past the context: the run holds only what the context allows and
    says why the output stopped."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt_token_ids": [1, 2, 3], "max_new_tokens": 1000000000000}\n')
    capsys.readouterr()
    assert main(["generate", "--model-path", str(tiny), "--prompts", str(good), "--context", "16",
                 "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["outputs"][0]
    assert len(out["token_ids"]) == 13 and "by the context length" in out["reason"]


def test_make_checkpoint_checks_every_argument_before_writing(tmp_path, capsys):
    """A bad `--draft-layers`, or a `--draft` folder that holds a checkpoint, refuses before the
    target is written: a corrected rerun then works."""
    target, draft = tmp_path / "t", tmp_path / "d"
    for extra in (["--draft-layers", "0,7"], ["--draft-layers", "1,0"], ["--draft-layers", ""]):
        assert main(["make-checkpoint", "llama", str(target), "--draft", str(draft), *extra]) == 2, extra
        assert not target.exists() and not draft.exists()
    assert main(["make-checkpoint", "llama", str(target), "--draft-layers", "0"]) == 2
    assert "--draft" in capsys.readouterr().err and not target.exists()
    assert main(["make-checkpoint", "llama", str(draft)]) == 0
    assert main(["make-checkpoint", "llama", str(target), "--draft", str(draft)]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err and not target.exists()
    assert main(["make-checkpoint", "llama", str(target), "--draft", str(target)]) == 2
    with pytest.raises(SystemExit) as refused:  # argparse's refusal: one line, exit code 2
        main(["make-checkpoint", "llama", str(target), "--seed", str(2**64)])
    assert refused.value.code == 2 and "--seed" in capsys.readouterr().err and not target.exists()
    assert main(["make-checkpoint", "llama", ""]) == 2 and "empty path" in capsys.readouterr().err
    assert main(["make-checkpoint", "llama", f"{tmp_path}/ck_\udcff"]) == 2  # a byte no UTF-8 name holds
    assert "not a UTF-8 path" in capsys.readouterr().err and not list(tmp_path.glob("ck_*"))


def test_bad_paths_and_families_exit_2(tiny, tmp_path, capsys):
    assert main(["generate", "--model-path", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["make-checkpoint", "mamba9", str(tmp_path / "m")]) == 2
    assert "unknown family" in capsys.readouterr().err
    assert main(["make-checkpoint", "gpt_oss", str(tiny)]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert main(["generate", "--model-path", str(tiny), "--prompt", "x", "--budget", "1KiB"]) == 2
    assert "floor" in capsys.readouterr().err


def test_make_checkpoint_prints_one_line_and_no_progress_bar(tmp_path, capsys):
    """A tiny checkpoint is one shard: transformers' "Writing model shards" bar is noise; it is
    kept off while saving and the caller's setting is left as it was."""
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()
    assert main(["make-checkpoint", "llama", str(tmp_path / "l")]) == 0
    out, err = capsys.readouterr()
    assert out.strip().splitlines() == [f"wrote a tiny llama checkpoint to {tmp_path / 'l'}"]
    assert "Writing" not in err and "it/s" not in err
    assert hf_logging.is_progress_bar_enabled()


def test_a_token_budget_below_the_checkpoint_interval_is_one_line_and_exit_2(capsys):
    """A model with recurrent state chunks its prefill on the checkpoint grid: under a smaller token
    budget a longer prompt would never be scheduled (the engine waited forever), so it is refused."""
    from support.engine import checkpoint_dir

    argv = ["generate", "--model-path", str(checkpoint_dir("qwen3_next")), "--prompt", "hello there kvchain",
            "--max-new-tokens", "2", "--page-size", "4", "--checkpoint-interval", "8", "--json"]
    capsys.readouterr()
    assert main([*argv, "--max-batched-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint interval 8" in err
    assert main([*argv, "--max-batched-tokens", "8"]) == 0  # one interval a step is enough
    assert len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]) == 2


@pytest.mark.parametrize("family", ["mamba2", "bamba"])
def test_a_state_family_serves_on_the_defaults(family, tmp_path, capsys):
    """A new user's first run on a recurrent family, no interval given: an attention-free Mamba2
    (no KV per token to weigh a checkpoint against) and a Mamba2 hybrid, transformers' tokens."""
    path = tmp_path / family
    assert main(["make-checkpoint", family, str(path)]) == 0
    capsys.readouterr()
    assert main(["generate", "--model-path", str(path), "--prompt", "hello kvchain", "--max-new-tokens", "6",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["outputs"][0]["token_ids"] == _greedy(path, list(b"hello kvchain"), 6)


def test_a_prompts_file_with_a_byte_order_mark_is_read(tiny, tmp_path, capsys):
    """Editors on Windows start a UTF-8 file with a byte-order mark; it was refused as invalid JSON."""
    prompts = tmp_path / "bom.jsonl"
    prompts.write_text('\ufeff{"prompt_token_ids": [1, 2, 3]}\n', encoding="utf-8")
    assert main(["generate", "--model-path", str(tiny), "--prompts", str(prompts), "--budget", "4MiB",
                 "--max-new-tokens", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"]) == 2
