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


def tokenize_conversation(tok, messages: list[dict], conv_id: str = "?") -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a mask over the assistant turns' tokens (content and
    end-of-turn marker, not the role header), found by rendering each prefix of the conversation."""
    full = render(tok, messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(tok, messages[:i], add_generation_prompt=True)
        upto = render(tok, messages[: i + 1])
        if not (full.startswith(upto) and upto.startswith(head)):
            raise StageError(f"conversation {conv_id}: the chat template does not render prefixes of a "
                             "conversation as prefixes (it rewrites earlier turns), so assistant tokens cannot "
                             "be located for the loss mask")
        spans.append((len(head), len(upto)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = [0] * len(ids)
    j = 0
    for t, (start, _end) in enumerate(enc["offset_mapping"]):
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        if j < len(spans) and spans[j][0] <= start < spans[j][1]:
            mask[t] = 1
    return ids, mask
