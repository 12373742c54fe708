"""Conversations as the target sees them: its chat template, token ids, and the loss mask (1 on the
assistant's tokens, the only positions a drafter is trained to predict)."""

from __future__ import annotations

from ..errors import StageError


def render(tok, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def first_turn_prompt(tok, messages: list[dict]) -> list[int]:
    """Token ids of a conversation up to its first user turn, ready for the assistant's reply: how every
    acceptance measurement (ours and the engines') prompts the target, so their figures compare."""
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return tok(render(tok, messages[: first_user + 1], add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def training_sequence(tok, messages: list[dict], prompt_ids: list[int], reply_ids: list[int], capped: list[bool],
                      conv_id: str = "?") -> tuple[list[int], list[int]]:
    """The sequence behind a conversation's last reply and its loss mask: `prompt_ids`, exactly what the target
    was fed, then `reply_ids`, exactly what it produced (mask 1). Earlier assistant turns sit inside the prompt
    as the chat template renders them: their content carries loss, their end-of-turn marker only where the
    target emitted one (`capped[i]` false for the i-th reply)."""
    history = messages[:-1]  # up to the last user turn; messages[-1] is the last reply
    rendered = render(tok, history, add_generation_prompt=True)
    spans, turn = [], 0
    for i, m in enumerate(history):
        if m["role"] != "assistant":
            continue
        head = render(tok, history[:i], add_generation_prompt=True)
        upto = render(tok, history[: i + 1])
        if not (rendered.startswith(upto) and upto.startswith(head)):
            raise StageError(f"conversation {conv_id}: the chat template does not render prefixes of a "
                             "conversation as prefixes (it rewrites earlier turns), so assistant tokens cannot "
                             "be located for the loss mask")
        content = m["content"]
        at = upto.find(content, len(head)) if content else len(head)
        if at < 0:  # a template that trims the content
            content = content.strip()
            at = upto.find(content, len(head))
        if at < 0:
            spans.append((len(head), len(upto)))
        else:
            spans.append((at, at + len(content)))
            if not capped[turn]:
                spans.append((at + len(content), len(upto)))
        turn += 1
    enc = tok(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if ids[len(ids) - len(prompt_ids):] != list(prompt_ids):
        raise StageError(f"conversation {conv_id}: the prompt the target was fed is not the chat template's "
                         "rendering of its history (the tokenizer is not deterministic?)")
    mask = [int(any(a <= start < b for a, b in spans)) for start, _end in enc["offset_mapping"]]
    mask = mask[len(ids) - len(prompt_ids):]
    return list(prompt_ids) + list(reply_ids), mask + [1] * len(reply_ids)
