"""A conversation to a prompt, as vLLM 0.26 renders one for ``LLM.chat`` and ``/v1/chat/completions``: the messages
parsed to plain text content (``parse_chat_messages``, ``vllm/entrypoints/chat_utils.py``), the model's chat
template applied to them as text (``HfRenderer.render_messages``, ``vllm/renderers/hf.py``), and that text
tokenized without special tokens (the template writes its own; ``BaseRenderer.default_chat_tok_params``,
``vllm/renderers/base.py``). Text only: an image or audio part is refused, not dropped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["parse_chat_messages", "render_chat"]


def _content_text(content: Any, where: str) -> str:
    """A message's content as the template sees it: a string as it is, OpenAI's list of parts as their texts
    joined by newlines (vLLM's ``"\\n".join(texts)``), ``None`` as the empty string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, (bytes, bytearray)):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are "
                                 f"supported, got {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"{where}: content part {j}'s 'text' must be a string, got {part.get('text')!r:.80}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}: content must be a string or a list of text parts, got {type(content).__name__}")


def parse_chat_messages(messages: Sequence[Mapping[str, Any]], where: str = "messages") -> list[dict[str, Any]]:
    """The messages as the chat template reads them: each one's ``role``, its content as text and its ``name``
    when it is a string (the keys vLLM's ``parse_chat_messages`` keeps for a text-only conversation). Refuses an
    empty conversation, a message that is not a dict or has no string ``role``. Pure."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"{where} must be a non-empty list of {{'role': ..., 'content': ...}} dicts")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"{where}[{i}] must be a dict with a string 'role', got {m!r:.80}")
        msg = {"role": m["role"], "content": _content_text(m.get("content"), f"{where}[{i}]")}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        parsed.append(msg)
    return parsed


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                add_special_tokens: bool = False, where: str = "messages") -> tuple[str, list[int]]:
    """The conversation's prompt text (the chat template applied, ``tokenize=False``) and its token ids
    (tokenized with ``add_special_tokens``, ``False`` as vLLM's chat default). The template's own refusals
    (a ``ValueError``, jinja2's ``TemplateError``) come through as they are."""
    text = tokenizer.apply_chat_template(
        parse_chat_messages(messages, where), tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message, tools=tools, chat_template=chat_template,
        **(chat_template_kwargs or {}))
    return text, list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
