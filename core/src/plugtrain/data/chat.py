"""Chat data: conversations checked, rendered with a chat template, and their assistant tokens.

A conversation is a JSON list of messages ``{"role": ..., "content": ...}``. It is rendered to
text by the model's chat template (``chat_template.jinja`` or ``tokenizer_config.json``'s
``chat_template`` next to the tokenizer.json, else :data:`DEFAULT_CHAT_TEMPLATE`), with jinja2
configured as transformers configures it (a sandboxed environment, ``trim_blocks`` and
``lstrip_blocks``, ``raise_exception``, the special tokens as variables), then tokenized
without added special tokens: the ids are those of transformers'
``tokenizer.apply_chat_template(messages, tokenize=True)`` (tests check it).

Which tokens are the assistant's (the only ones trained on by default) is found by rendering
incrementally rather than by a ``{% generation %}`` marker, which few templates have: assistant
message ``i`` spans the characters between the rendering of messages ``[:i]`` with the
generation prompt and the rendering of messages ``[:i + 1]``; it holds the reply and the
template's end-of-turn text (``<|eot_id|>``), so the model learns to stop. A token is the
assistant's when its first character lies in such a span. This needs every rendering of a
prefix to be a prefix of the whole conversation's; a template that rewrites earlier turns (one
that drops past reasoning) breaks it and is refused, naming the conversation.

Conversations read from a file (:class:`Conversation`) carry their ``path:line``: an error
while one is encoded (the template's own ``raise_exception`` included) names it.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from plugtrain.data.tokenizer import BOS_TOKEN, EOS_TOKEN, Tokenizer
from plugtrain.errors import DataError, MissingFileError, one_line

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have."""
DEFAULT_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""The template of a tokenizer with none: each turn ``<|role|>\\n content <eos>\\n`` after a
BOS, in plain text plus the two special tokens every plugtrain tokenizer has, so that it needs
no new token; a reply ends with the EOS, where ``generate --chat`` stops."""


def check_conversation(record: Any, where: str) -> list[dict[str, str]]:
    """``record``'s ``messages``, checked; a :class:`DataError` naming ``where`` otherwise."""
    fix = 'give {"messages": [{"role": ..., "content": "..."}, ...]}'
    if not isinstance(record, dict) or "messages" not in record:
        raise DataError(f"{where} has no 'messages' (chat data): {fix}")
    return check_messages(record["messages"], where, "messages", fix)


def check_messages(messages: Any, where: str, key: str, fix: str) -> list[dict[str, str]]:
    """The list of messages under ``key`` of the record at ``where``, checked; a
    :class:`DataError` that ends with ``fix`` otherwise."""
    if not isinstance(messages, list) or not messages:
        what = "is empty" if messages == [] else f"is a {type(messages).__name__}, not a list"
        raise DataError(f"{where}: {key!r} {what}: {fix}")
    named = "message" if key == "messages" else f"{key!r} message"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: {named} {i} is not a JSON object: {fix}")
        if message.get("role") not in ROLES:
            raise DataError(
                f"{where}: {named} {i} has role {message.get('role')!r}: give one of {ROLES}"
            )
        if not isinstance(message.get("content"), str):
            what = "no 'content'" if "content" not in message else "a 'content' that is no string"
            raise DataError(f"{where}: {named} {i} has {what}: {fix}")
    return messages


class Conversation(list):
    """A conversation's checked messages (a list, as :func:`check_conversation` gives them)
    and ``where`` it was read, ``path:line``, which errors while encoding it name."""

    def __init__(self, messages: list[dict[str, str]], where: str) -> None:
        super().__init__(messages)
        self.where = where


class _TemplateRaised(Exception):
    """A chat template's own ``raise_exception(message)``."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json gives it: a string or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


@dataclass(frozen=True)
class ChatTemplate:
    """A jinja chat template and the special tokens it is rendered with (picklable: workers
    of ``prepare-data`` receive it)."""

    source: str
    """The template's text."""
    origin: str
    """Where it was read, for messages and the run's records."""
    special_tokens: tuple[tuple[str, str], ...] = (
        ("bos_token", BOS_TOKEN),
        ("eos_token", EOS_TOKEN),
    )
    """The variables ``bos_token``, ``eos_token`` (and ``unk_token``, ``pad_token`` when the
    tokenizer's config names them) the template sees."""

    def __post_init__(self) -> None:
        import jinja2

        try:  # compiled where it is read, so that a broken one is named before any data
            _compiled(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(
                f"chat template ({self.origin}) is not valid jinja ({one_line(e)}): fix it, or "
                "give another (data.chat_template)"
            ) from e

    @property
    def sha256(self) -> str:
        """The sha256 of the template's text: ``sha256sum`` of its ``chat_template.jinja``."""
        return hashlib.sha256(self.source.encode()).hexdigest()

    def record(self) -> dict[str, Any]:
        """What a run records beside the template's text (a checkpoint's
        ``chat_template.json``, a prepared folder's manifest): where it was read, its
        :attr:`sha256` and its special tokens."""
        return {
            "origin": self.origin,
            "sha256": self.sha256,
            "special_tokens": dict(self.special_tokens),
        }

    @classmethod
    def from_record(
        cls, source: str, record: Mapping[str, Any], where: str, *, origin: str = ""
    ) -> ChatTemplate:
        """The template of text ``source`` and its :meth:`record`, read from ``where`` (its
        :attr:`origin` unless ``origin`` is given); a :class:`DataError` when the text is not
        the one recorded."""
        tokens = tuple(sorted(record["special_tokens"].items()))
        template = cls(source, origin or where, tokens)
        if template.sha256 != record["sha256"]:
            raise DataError(
                f"{where} has sha256 {template.sha256[:12]}, but its record says "
                f"{record['sha256'][:12]}: it was changed; restore it or write it again"
            )
        return template

    @classmethod
    def for_tokenizer(
        cls, tokenizer_path: str | os.PathLike[str], override: str | os.PathLike[str] = ""
    ) -> ChatTemplate:
        """The template of the tokenizer.json at ``tokenizer_path``: ``override`` (a .jinja file)
        when given, else the folder's ``chat_template.jinja``, else its tokenizer_config.json's
        ``chat_template``, else :data:`DEFAULT_CHAT_TEMPLATE`; the special tokens from that
        config."""
        folder = Path(tokenizer_path).parent
        config: dict[str, Any] = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except ValueError as e:
                raise DataError(f"{config_path} is not valid JSON ({e}): fix or remove it") from e
        tokens = {
            "bos_token": _token_text(config.get("bos_token")) or BOS_TOKEN,
            "eos_token": _token_text(config.get("eos_token")) or EOS_TOKEN,
        }
        for name in ("unk_token", "pad_token"):
            if text := _token_text(config.get(name)):
                tokens[name] = text
        special = tuple(sorted(tokens.items()))
        if override:
            path = Path(override)
            if not path.is_file():
                raise MissingFileError(
                    f"data.chat_template '{path}' not found: give a .jinja file, or leave it "
                    f"empty for the tokenizer folder's template"
                )
            return cls(path.read_text(), str(path), special)
        if (folder / "chat_template.jinja").is_file():
            path = folder / "chat_template.jinja"
            return cls(path.read_text(), str(path), special)
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: transformers uses "default"
            template = next(
                (t.get("template") for t in template if t.get("name") == "default"), None
            )
        if isinstance(template, str):
            return cls(template, f"{config_path} chat_template", special)
        return cls(DEFAULT_CHAT_TEMPLATE, "plugtrain's default chat template", special)

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text, as transformers renders it."""
        try:
            return _compiled(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **dict(self.special_tokens),
            )
        except _TemplateRaised as e:
            raise DataError(
                f"chat template raised: {e} (template: {self.origin}): fix the conversation, or "
                "give a template that accepts it (data.chat_template; prepare-data: "
                "--chat-template)"
            ) from e
        except Exception as e:  # jinja2's errors
            raise DataError(
                f"chat template ({self.origin}) failed on a conversation: {type(e).__name__}: {e}"
            ) from e

    def reply_end(self) -> str:
        """The text the template writes after an assistant's reply (``<|eot_id|>``,
        ``<|im_end|>\\n``): where a generated reply ends."""
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]
        whole = self.render(probe)
        return whole[whole.rindex("!") + 1 :]

    def assistant_spans(
        self, messages: list[dict[str, str]], text: str, first: int = 0
    ) -> list[tuple[int, int]]:
        """Character spans of ``text`` (the conversation's rendering) that the assistant's
        messages from message ``first`` on and their end-of-turn text cover (see the module
        doc)."""
        spans = []
        for i, message in enumerate(messages):
            if i < first or message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True) if i else ""
            upto = self.render(messages[: i + 1])
            if not (text.startswith(upto) and upto.startswith(before)):
                raise DataError(
                    f"chat template ({self.origin}) renders a conversation's first {i + 1} "
                    f"messages as other than the start of the whole: it rewrites earlier turns, "
                    f'so the assistant\'s tokens cannot be found; set data.chat_loss = "all" '
                    f"or give another data.chat_template"
                )
            spans.append((len(before), len(upto)))
        return spans


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    """The template compiled in a jinja2 environment set up as transformers sets up its own."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body (the mask comes from
        incremental rendering, see the module doc)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise _TemplateRaised(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
        # jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def encode_conversation(
    messages: list[dict[str, str]], template: ChatTemplate, tokenizer: Tokenizer, first: int = 0
) -> tuple[list[int], np.ndarray]:
    """The conversation's token ids and, per token, whether it is the assistant's (in a
    message from message ``first`` on: a preference pair's completion)."""
    text = template.render(messages)
    ids, offsets = tokenizer.encode_with_offsets(text)
    mask = np.zeros(len(ids), dtype=np.uint8)
    starts = np.array([start for start, _ in offsets], dtype=np.int64)
    for start, end in template.assistant_spans(messages, text, first):
        mask[(starts >= start) & (starts < end)] = 1
    return ids, mask


@dataclass(frozen=True)
class ChatOptions:
    """How a file is read as chat data: the ``data`` keys, and the longest conversation kept."""

    format: str = "auto"
    """``data.format``: ``auto``, ``text`` or ``chat``."""
    template: str = ""
    """``data.chat_template``: a .jinja file, or empty for the tokenizer folder's."""
    max_tokens: int = 0
    """Conversations longer than this (``training.seq_len``) are cut or dropped; 0: none."""
    overlong: str = "truncate"
    """``data.chat_overlong``: ``truncate`` or ``drop``."""


@dataclass(frozen=True)
class ChatEncoder:
    """Encodes conversations for ``prepare-data``: the template, and what to do with the long
    ones (picklable, for its worker processes)."""

    template: ChatTemplate
    max_tokens: int = 0
    overlong: str = "truncate"

    def key(self) -> dict[str, Any]:
        """What decides the tokens written, for a prepared folder's up-to-date check."""
        source = json.dumps([self.template.source, self.template.special_tokens])
        return {
            "chat_template_sha256": hashlib.sha256(source.encode()).hexdigest(),
            "max_tokens": self.max_tokens,
            "overlong": self.overlong,
        }

    def encode(
        self, conversations: list[list[dict[str, str]]], tokenizer: Tokenizer
    ) -> tuple[list[list[int]], list[np.ndarray], int, int, list[int]]:
        """Each kept conversation's ids and assistant mask, how many were truncated and
        dropped, and every conversation's length before any was cut; an error names a
        :class:`Conversation`'s ``path:line``."""
        ids, masks, truncated, dropped, lengths = [], [], 0, 0, []
        for messages in conversations:
            try:
                tokens, mask = encode_conversation(messages, self.template, tokenizer)
            except DataError as e:
                if not isinstance(messages, Conversation):
                    raise
                raise DataError(f"{messages.where}: {e}") from e
            lengths.append(len(tokens))
            if self.max_tokens and len(tokens) > self.max_tokens:
                if self.overlong == "drop":
                    dropped += 1
                    continue
                truncated += 1
                tokens, mask = tokens[: self.max_tokens], mask[: self.max_tokens]
            ids.append(tokens)
            masks.append(mask)
        return ids, masks, truncated, dropped, lengths


LENGTH_PERCENTILES = (90, 99, 100)
"""The percentiles of conversation lengths a prepared folder records (100: the longest)."""


def length_percentiles(histogram: np.ndarray) -> dict[str, int]:
    """``{"p90": n, ...}`` of :data:`LENGTH_PERCENTILES` from ``histogram`` (the count of
    conversations of each length): the shortest ``n`` that at least that share of the
    conversations fit in, so ``training.seq_len`` ``n`` cuts none of them."""
    below = np.cumsum(histogram)
    return {
        f"p{p}": int(np.searchsorted(below, -(-p * int(below[-1]) // 100)))
        for p in LENGTH_PERCENTILES
    }


def fitting_seq_len(chat: Mapping[str, Any]) -> str:
    """What a run whose conversations were cut or dropped could set instead: a prepared
    folder's manifest ``chat`` section's length percentiles, said as seq_lens; empty when none
    was cut, or the folder predates the record."""
    fit = chat.get("lengths")
    if not fit or not (chat["truncated"] or chat["dropped"]):
        return ""
    said, longest = [f"{fit['p100']} fits all of them"], fit["p100"]
    for p in sorted(LENGTH_PERCENTILES[:-1], reverse=True):
        if fit[f"p{p}"] < longest:  # a share that needs no less than a larger one is not news
            said.append(f"{fit[f'p{p}']} fits {p}%")
            longest = fit[f"p{p}"]
    return f": training.seq_len {', '.join(said)}"
