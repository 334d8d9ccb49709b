"""explorer.prompt_format: chat (the task as one user message through the tokenizer's
chat template), raw (the text as is), unset (chat when the tokenizer has a template);
what the explorer sends and which prompt tokens its samples hold. No inference server:
the client is replaced by a recorder."""

from __future__ import annotations

import json
import logging

import pytest

from rft_contract.config import ConfigError, load_explorer_config
from rft_rollout import explorer as explorer_mod
from rft_rollout.explorer import Explorer, has_chat_template, render_prompt, resolve_prompt_format
from rft_rollout.rollouts import load_tokenizer
from tests.fixtures.models import save_tiny_tokenizer

# SmolLM2-Instruct's template (ChatML with a default system message).
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% endif %}")
# Over the tiny vocabulary, so every character is a token: "<bos>?3+4=" -> [bos, ?, 3, +, 4, =].
TINY_TEMPLATE = ("{{ bos_token }}{% for m in messages %}?{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}={% endif %}")


def save_bos_tokenizer(path, template: str | None = TINY_TEMPLATE) -> None:
    """The tiny character-level tokenizer, but one that adds a BOS when it encodes (a
    TemplateProcessing post-processor, as Llama-3's tokenizer.json has), saved with a chat
    template that writes `{{ bos_token }}` itself (Llama-3-style)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from tests.fixtures.models import tiny_vocab

    vocab = {t: i for i, t in enumerate(tiny_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", vocab["<bos>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(path))


@pytest.fixture(scope="module")
def bos_tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bos-tok")
    save_bos_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return path


def fresh_tokenizer(tok_dir, template: str | None = None):
    tok = load_tokenizer(str(tok_dir))
    if template is not None:
        tok.chat_template = template
    return tok


def config(prompt_format=None, reward="math_accuracy"):
    section = {"replicas": 1, "taskset_uri": "unused.jsonl", "rollouts_per_task": 2,
               "sampling": {"max_tokens": 4}, "reward": reward}
    if prompt_format is not None:
        section["prompt_format"] = prompt_format
    return load_explorer_config({
        "model": {"path": "unused"}, "algorithm": {"name": "grpo"},
        "trainer": {"batch_size": 4, "total_steps": 1, "image": "t:1"},
        "checkpoint": {"uri": "s3://unused/run"}, "buffer": {"uri": "/nonexistent/buffer"},
        "inference": {"replicas": 1}, "explorer": section})


TASKS = [{"id": "t0", "prompt": "3+4", "answer": "7"}, {"id": "t1", "prompt": "2-5", "answer": "-3"}]


def make(tokenizer, prompt_format=None, reward="math_accuracy"):
    return Explorer(config(prompt_format, reward), ["http://127.0.0.1:9"], tokenizer=tokenizer,
                    tasks=[dict(t) for t in TASKS])


# ------------------------------------------------------------------ choosing the format


def test_the_tiny_tokenizer_has_no_template(tok_dir):
    assert not has_chat_template(fresh_tokenizer(tok_dir))
    assert has_chat_template(fresh_tokenizer(tok_dir, TINY_TEMPLATE))


@pytest.mark.parametrize("setting, template, want", [
    (None, TINY_TEMPLATE, "chat"),   # the default follows the tokenizer
    (None, None, "raw"),
    ("chat", TINY_TEMPLATE, "chat"),
    ("raw", TINY_TEMPLATE, "raw"),   # raw wins over a template
    ("raw", None, "raw"),
])
def test_resolve_prompt_format(tok_dir, setting, template, want):
    tok = fresh_tokenizer(tok_dir, template)
    assert resolve_prompt_format(setting, tok) == want
    assert make(tok, setting).prompt_format == want


def test_chat_without_a_template_is_a_config_error(tok_dir):
    with pytest.raises(ConfigError,
                       match=r"^explorer\.prompt_format: 'chat' needs a tokenizer with a chat template"):
        resolve_prompt_format("chat", fresh_tokenizer(tok_dir))
    with pytest.raises(ConfigError, match=r"^explorer\.prompt_format"):
        make(fresh_tokenizer(tok_dir), "chat")
    with pytest.raises(ConfigError, match=r"explorer\.prompt_format: must be 'chat' or 'raw'"):
        resolve_prompt_format("Chat", fresh_tokenizer(tok_dir, TINY_TEMPLATE))


def test_a_template_that_fails_is_a_config_error_at_start(tok_dir):
    tok = fresh_tokenizer(tok_dir, "{{ raise_exception('system message required') }}")
    with pytest.raises(ConfigError, match=r"explorer\.prompt_format: .*task 't0'.*system message required"):
        make(tok)


def test_cli_exits_78_when_chat_is_forced_without_a_template(tok_dir, tmp_path, caplog):
    (tmp_path / "tasks.jsonl").write_text("\n".join(json.dumps(t) for t in TASKS))
    data = config("chat").to_dict()
    data["explorer"]["taskset_uri"] = str(tmp_path / "tasks.jsonl")
    (tmp_path / "config.json").write_text(json.dumps(data))
    with caplog.at_level(logging.ERROR, logger="rft_rollout.explorer"):
        rc = explorer_mod.main(["--config", str(tmp_path / "config.json"), "--tokenizer", str(tok_dir),
                                "--endpoints", "http://127.0.0.1:9"])
    assert rc == explorer_mod.EX_CONFIG == 78
    assert "explorer.prompt_format: 'chat' needs a tokenizer with a chat template" in caplog.text


def test_the_format_is_logged_once_at_start(tok_dir, caplog):
    with caplog.at_level(logging.INFO, logger="rft_rollout.explorer"):
        make(fresh_tokenizer(tok_dir, TINY_TEMPLATE))
    events = [json.loads(r.getMessage()) for r in caplog.records if '"prompt_format"' in r.getMessage()]
    assert events == [{"event": "prompt_format", "prompt_format": "chat", "setting": None,
                       "chat_template": True, "example": "<bos>?3+4="}]


# ------------------------------------------------------------------ rendering


def test_chat_renders_one_user_message_with_the_generation_prompt(tok_dir):
    tok = fresh_tokenizer(tok_dir, SMOL_TEMPLATE)
    assert render_prompt("What is 6*7?", "chat", tok) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    assert render_prompt("What is 6*7?", "raw", tok) == "What is 6*7?"
    assert make(tok).prompt_text(TASKS[0]) == render_prompt("3+4", "chat", tok)


def test_a_template_saved_with_the_tokenizer_makes_chat_the_default(tok_dir, tmp_path):
    tok = fresh_tokenizer(tok_dir, TINY_TEMPLATE)
    tok.save_pretrained(str(tmp_path / "chat-tok"))  # as a chat model ships it
    loaded = load_tokenizer(str(tmp_path / "chat-tok"))
    assert make(loaded).prompt_format == "chat"
    assert render_prompt("3+4", "chat", loaded) == "<bos>?3+4="


# ------------------------------------------------------------------ what is sent and stored


RECEIVED: list[str] = []


def recording_reward(prompt, response, answer):
    RECEIVED.append(prompt)
    return 1.0


@pytest.mark.parametrize("setting, template, sent", [
    ("chat", TINY_TEMPLATE, ["<bos>?3+4=", "<bos>?2-5="]),
    (None, TINY_TEMPLATE, ["<bos>?3+4=", "<bos>?2-5="]),
    ("raw", TINY_TEMPLATE, ["3+4", "2-5"]),
    (None, None, ["3+4", "2-5"]),
])
def test_the_rendered_prompt_is_sent_and_its_tokens_are_stored(tok_dir, setting, template, sent):
    tok = fresh_tokenizer(tok_dir, template)
    explorer = make(tok, setting, reward=f"{__name__}:recording_reward")
    bodies = []

    def complete(body):  # a server that returns no prompt_token_ids: the explorer tokenizes
        bodies.append(body)
        return {"weights_version": 1, "choices": [
            {"index": k, "text": "7", "finish_reason": "length"} for k in range(body["n"])]}, None

    explorer.client.complete = complete
    RECEIVED.clear()
    samples = explorer._rollouts([(0, 0), (0, 1)])
    assert sorted(b["prompt"] for b in bodies) == sorted(sent)
    assert [s.prompt_ids for s in samples] == ([tok(sent[0])["input_ids"]] * 2
                                               + [tok(sent[1])["input_ids"]] * 2)
    if sent[0] != "3+4":
        assert samples[0].prompt_ids == [tok.bos_token_id] + tok("?3+4=")["input_ids"]
    assert RECEIVED == ["3+4", "3+4", "2-5", "2-5"]  # rewards get the task's own text


# ------------------------------------------------------------------ one BOS


def test_the_bos_tokenizer_adds_a_bos_and_its_template_writes_one(bos_tok_dir):
    tok = load_tokenizer(str(bos_tok_dir))
    bos = tok.bos_token_id
    assert tok("3+4")["input_ids"] == [bos] + tok("3+4", add_special_tokens=False)["input_ids"]
    rendered = render_prompt("3+4", "chat", tok)
    assert rendered == "<bos>?3+4="
    assert tok(rendered)["input_ids"].count(bos) == 2  # the double BOS this guards against


@pytest.mark.parametrize("setting", ["chat", None, "raw"])
def test_a_tokenizer_that_adds_a_bos_gets_exactly_one(bos_tok_dir, setting):
    """Chat: the template wrote the BOS, so the request says add_special_tokens false and the
    fallback tokenization (a server that returns no ids) adds none; raw: the tokenizer's
    BOS, the server's default."""
    tok = load_tokenizer(str(bos_tok_dir))
    explorer = make(tok, setting, reward=f"{__name__}:recording_reward")
    bodies = []

    def complete(body):
        bodies.append(body)
        return {"weights_version": 1, "choices": [
            {"index": k, "text": "7", "finish_reason": "length"} for k in range(body["n"])]}, None

    explorer.client.complete = complete
    samples = explorer._rollouts([(0, 0)])
    chat = setting != "raw"
    assert [b.get("add_special_tokens", True) for b in bodies] == [not chat]
    want = [tok.bos_token_id] + tok("?3+4=" if chat else "3+4", add_special_tokens=False)["input_ids"]
    assert [s.prompt_ids for s in samples] == [want, want]
    assert all(s.prompt_ids.count(tok.bos_token_id) == 1 for s in samples)
