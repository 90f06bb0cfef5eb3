"""Supervised fine-tuning samples: token ids and, per token, whether it is a target.

    prompt/completion  the prompt after the special tokens the tokenizer starts a text with
                       (BOS), then the completion and the end-of-text token, tokenised apart
                       (a prompt ends where generation starts); the completion and end-of-text
                       are targets
    messages           the conversation as the model's chat template renders it, tokenised once;
                       each assistant message's content and the text that closes its turn
                       (e.g. ``<|im_end|>``) are targets, located by character offsets

The assistant turns are found by rendering the conversation with each message's content replaced
by a marker: the markers' places are where the contents go, provided the template treats
contents as opaque text (checked: the marked rendering with the contents put back, as given or
trimmed, must equal the real one). So templates need not render a conversation's prefix as a
prefix of the whole (Qwen3's and Phi-3's do not). A turn's closing is what the template writes
after the last assistant message's content, as far as the text after each turn's content agrees
with it.
"""

from __future__ import annotations

import logging

from .files import Records

log = logging.getLogger("l2l_worker")

CHUNK = 10_000  # texts per tokenizer call (tokens.py too)
Samples = list[tuple[list[int], list[int]]]  # (token ids, target flags) per sample


def _leading_specials(tokenizer) -> list[int]:
    """The special tokens the tokenizer puts before a text (e.g. BOS), not those after it (a
    tokenizer that appends EOS or SEP would otherwise end the prompt with one)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return full[:k]
    return []


def prompt_samples(records: Records, tokenizer) -> Samples:
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    if not eos:
        log.warning("the tokenizer has no end-of-text token: completions train without one")
    first = _leading_specials(tokenizer)
    samples = []
    for lo in range(0, len(records.texts), CHUNK):
        prompts = tokenizer(records.texts[lo:lo + CHUNK], add_special_tokens=False,
                            return_attention_mask=False)
        completions = tokenizer(records.completions[lo:lo + CHUNK], add_special_tokens=False,
                                return_attention_mask=False)
        for p, c in zip(prompts["input_ids"], completions["input_ids"]):
            p = first + p
            samples.append((p + c + eos, [0] * len(p) + [1] * (len(c) + len(eos))))
    return samples


def _marker(i: int) -> str:
    return f"\ue000l2l-{i}\ue001"  # private-use characters: in no real text


def assistant_spans(chat: list[dict], render) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns (content and
    closing text); raises ValueError when the template does not treat contents as text (it
    may trim them, as Llama 3's and Gemma's do)."""
    marked = [dict(m, content=_marker(i)) for i, m in enumerate(chat)]
    shown, real = render(marked), render(chat)
    for shape in (str, str.strip):  # contents as given, or trimmed
        text, places = _put_back(shown, [shape(m["content"]) for m in chat])
        if text == real:
            break
    else:
        raise ValueError("the chat template renders this conversation differently by its "
                         "contents; its assistant turns cannot be told apart")
    # what closes an assistant turn: what follows the content when it is the last message
    last = max(i for i, m in enumerate(chat) if m["role"] == "assistant")
    ending = render(marked[:last + 1])
    closing = ending[ending.rindex(_marker(last)) + len(_marker(last)):]
    spans = []
    for (start, end), m in zip(places, chat):
        if m["role"] == "assistant":
            k = 0
            while k < len(closing) and end + k < len(text) and text[end + k] == closing[k]:
                k += 1
            spans.append((start, end + k))
    return text, spans


def _put_back(shown: str, contents: list[str]) -> tuple[str, list[tuple[int, int]]]:
    """``shown`` (rendered with markers) with message i's marker replaced by ``contents[i]``,
    and where each content lies in the result."""
    pieces, places, at, size = [], [], 0, 0
    for i, content in enumerate(contents):
        where = shown.find(_marker(i), at)
        if where < 0:
            raise ValueError(f"the chat template leaves out or alters message {i}")
        pieces += [shown[at:where], content]
        size += where - at
        places.append((size, size + len(content)))
        size += len(content)
        at = where + len(_marker(i))
    pieces.append(shown[at:])
    return "".join(pieces), places


def _inside(lo: int, hi: int, a: int, b: int) -> bool:
    """Is the token at characters [lo, hi) part of the turn [a, b)? It may begin before the turn
    (a space carried into the first word) but not run past its end (the closing is matched by
    characters: "<|end|>\n<|" of "<|end|>\n<|endoftext|>" must not take the next turn's
    "<|user|>")."""
    if lo == hi:  # a token of no characters
        return a <= lo < b
    return lo < b and a < hi <= b


def chat_samples(records: Records, tokenizer) -> Samples:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(": messages need a chat template, and the model's tokenizer has none "
                         "(add chat_template.jinja, or use prompt/completion records)")
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(": messages need a fast tokenizer (tokenizer.json: character offsets "
                         "mark the assistant turns)")

    def render(messages) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False)

    samples = []
    for k, chat in enumerate(records.chats):
        try:
            text, spans = assistant_spans(chat, render)
        except Exception as e:  # the template's own refusals (jinja's TemplateError too)
            raise ValueError(f"{records.at(k)}: the chat template: {e}") from None
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True,
                        return_attention_mask=False)
        flags = [int(any(_inside(lo, hi, a, b) for a, b in spans))
                 for lo, hi in out["offset_mapping"]]
        samples.append((out["input_ids"], flags))
    return samples
