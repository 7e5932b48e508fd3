"""Tests of plugtrain.data.chat: chat templates rendered as transformers renders them, the
assistant-token mask, and the one-line refusals of bad conversations.

The judge is transformers itself: for a tokenizer folder saved by ``save_pretrained`` with a
Llama 3 style and a ChatML template, every conversation of :data:`CONVERSATIONS` must give the
ids of ``tokenizer.apply_chat_template(messages, tokenize=True)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugtrain.data.chat import (
    DEFAULT_CHAT_TEMPLATE,
    ChatTemplate,
    check_conversation,
    encode_conversation,
)
from plugtrain.data.tokenizer import Tokenizer
from plugtrain.errors import DataError
from plugtrain.testing import SAMPLE
from plugtrain.testing.hf import hf_chat_tokenizer

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "What is a sonnet?"},
     {"role": "assistant", "content": "A poem of fourteen lines."}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "  Who wrote Hamlet?  "},
     {"role": "assistant", "content": "Shakespeare."},
     {"role": "user", "content": "And Macbeth?\n"},
     {"role": "assistant", "content": " Shakespeare, again. "}],
    [{"role": "user", "content": "naïve café — 東京 🎭\t"},
     {"role": "assistant", "content": "{\"json\": [1, 2]} <b>&amp;</b>\n\n"}],
]  # fmt: skip
"""Single and multi-turn, a system prompt, surrounding whitespace (Llama 3 trims it), non-ASCII
text and characters jinja's HTML escaping would change."""


@pytest.fixture(scope="module", params=["llama3", "chatml"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # ChatML's template in tokenizer_config.json: both places transformers reads are covered.
    path = tmp_path_factory.mktemp(request.param)
    return hf_chat_tokenizer(path, request.param, in_config=request.param == "chatml")


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)))
def test_ids_equal_transformers_apply_chat_template(folder: Path, index: int) -> None:
    messages = CONVERSATIONS[index]
    theirs = transformers.AutoTokenizer.from_pretrained(folder)
    template = ChatTemplate.for_tokenizer(folder / "tokenizer.json")
    ids, mask = encode_conversation(
        messages, template, Tokenizer.from_file(folder / "tokenizer.json")
    )
    assert ids == theirs.apply_chat_template(messages, tokenize=True, return_dict=False)
    prompt = theirs.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert template.render(messages[:1], add_generation_prompt=True) == prompt
    # The mask: the assistant's replies with their end-of-turn token, nothing else.
    tokenizer = Tokenizer.from_file(folder / "tokenizer.json")
    marked = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    end = "<|eot_id|>" if "llama3" in folder.name else "<|im_end|>\n"
    strip = str.strip if "llama3" in folder.name else str
    replies = [strip(m["content"]) + end for m in messages if m["role"] == "assistant"]
    assert marked == "".join(replies)


def test_the_default_template_serves_a_tokenizer_without_one(tmp_path: Path) -> None:
    template = ChatTemplate.for_tokenizer(SAMPLE / "tokenizer.json")
    assert template.source == DEFAULT_CHAT_TEMPLATE
    tokenizer = Tokenizer.from_file(SAMPLE / "tokenizer.json")
    ids, mask = encode_conversation(CONVERSATIONS[0], template, tokenizer)
    text = "<|begin_of_text|><|user|>\nWhat is a sonnet?<|end_of_text|>\n<|assistant|>\n"
    assert template.render(CONVERSATIONS[0][:1], add_generation_prompt=True) == text
    assert ids[0] == tokenizer.bos_id
    marked = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert marked == "A poem of fourteen lines.<|end_of_text|>\n"
    override = tmp_path / "mine.jinja"
    override.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ChatTemplate.for_tokenizer(SAMPLE / "tokenizer.json", override).source.startswith("{%")


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": "x"}, "has no 'messages'"),
        ({"messages": []}, "'messages' is empty"),
        ({"messages": "hi"}, "'messages' is a str, not a list"),
        ({"messages": ["hi"]}, "message 0 is not a JSON object"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "message 0 has role 'bot': give one of"),
        ({"messages": [{"role": "user"}]}, "message 0 has no 'content'"),
        ({"messages": [{"role": "user", "content": 3}]}, "a 'content' that is no string"),
    ],
)
def test_bad_conversations_are_refused_naming_the_line(record: object, message: str) -> None:
    with pytest.raises(DataError, match=rf"^chat\.jsonl line 7.*{message}"):
        check_conversation(record, "chat.jsonl line 7")


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    rewriting = "{% for m in messages %}{{ m.content if loop.last else '...' }}{% endfor %}"
    template = ChatTemplate(rewriting, "test")
    tokenizer = Tokenizer.from_file(SAMPLE / "tokenizer.json")
    with pytest.raises(DataError, match=r"rewrites earlier turns.*data\.chat_loss"):
        encode_conversation(CONVERSATIONS[1], template, tokenizer)
