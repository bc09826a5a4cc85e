"""A deterministic, reversible tokenizer and a ChatML chat template for the simulator.

Real tokenizers are large learned vocabularies; what a router can observe of them is only that
the same text always gives the same ids, that a shared text prefix gives a shared id prefix, and
that roughly 3–4 bytes make one token. This tokenizer keeps exactly those properties without any
data files: text is pre-split GPT-2 style into word pieces, and each piece's UTF-8 bytes are cut
into chunks of at most three bytes, each chunk mapping to one id by a reversible formula.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Tokenizer", "ChatTemplateError", "render_chat", "SPECIAL_TOKENS"]

# Special tokens first so that they are never split; the ids below them stay stable.
SPECIAL_TOKENS: dict[str, int] = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
_ID_TO_SPECIAL = {v: k for k, v in SPECIAL_TOKENS.items()}
_BYTE1 = 3  # ids 3..258: one byte
_BYTE2 = _BYTE1 + 256  # two bytes: 65,536 ids
_BYTE3 = _BYTE2 + 65536  # three bytes: 2**24 ids
VOCAB_SIZE = _BYTE3 + (1 << 24)

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
# GPT-2's pre-tokenizer shape: contractions, words and punctuation runs with one leading space.
_PIECE_RE = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+""")


class ChatTemplateError(ValueError):
    """A chat request that cannot be rendered (bad roles, content shapes or flags)."""


@dataclass(frozen=True)
class Tokenizer:
    """Deterministic byte-chunk tokenizer. `bos_id` is prepended when special tokens are added."""

    bos_id: int | None = None
    eos_id: int = 0

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = [self.bos_id] if add_special_tokens and self.bos_id is not None else []
        for part in _SPECIAL_RE.split(text):
            if not part:
                continue
            special = SPECIAL_TOKENS.get(part)
            if special is not None:
                ids.append(special)
                continue
            for piece in _PIECE_RE.findall(part):
                ids.extend(_chunk_ids(piece.encode("utf-8")))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < _BYTE1:
            return _ID_TO_SPECIAL[token_id].encode()
        if token_id < _BYTE2:
            return bytes([token_id - _BYTE1])
        if token_id < _BYTE3:
            return (token_id - _BYTE2).to_bytes(2, "big")
        if token_id < VOCAB_SIZE:
            return (token_id - _BYTE3).to_bytes(3, "big")
        raise ValueError(f"token id {token_id} out of vocabulary (size {VOCAB_SIZE})")

    def token_str(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def valid_id(self, token_id: object) -> bool:
        return isinstance(token_id, int) and not isinstance(token_id, bool) and 0 <= token_id < VOCAB_SIZE


def _chunk_ids(data: bytes) -> Iterable[int]:
    for i in range(0, len(data), 3):
        chunk = data[i : i + 3]
        if len(chunk) == 3:
            yield _BYTE3 + int.from_bytes(chunk, "big")
        elif len(chunk) == 2:
            yield _BYTE2 + int.from_bytes(chunk, "big")
        else:
            yield _BYTE1 + chunk[0]


_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def message_text(content: object, where: str) -> str:
    """OpenAI message content: a string, null, or a list of parts of which text parts render."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise ChatTemplateError(f"{where}.content[{i}] must be an object with a 'type'")
            if part["type"] in ("text", "input_text"):
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatTemplateError(f"{where}.content[{i}].text must be a string")
                out.append(text)
            # Images/audio have no text form here; a real engine would add placeholder tokens.
        return "".join(out)
    raise ChatTemplateError(f"{where}.content must be a string or a list of content parts")


def render_chat(
    messages: object,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Render OpenAI chat messages with ChatML, the template Qwen-style models ship."""
    if add_generation_prompt and continue_final_message:
        raise ChatTemplateError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError("messages must be a list of message objects")
    parts: list[str] = []
    last = len(messages) - 1
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"{where} must be an object")
        role = msg.get("role")
        if role not in _ROLES:
            raise ChatTemplateError(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}")
        text = message_text(msg.get("content"), where)
        if i == last and continue_final_message:
            parts.append(f"<|im_start|>{role}\n{text}")
        else:
            parts.append(f"<|im_start|>{role}\n{text}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


# One-token words (a leading space and at most two letters) make the simulated output; each is a
# single id, so output token counts equal what the engine reports.
OUTPUT_WORDS: tuple[str, ...] = tuple(
    " " + w
    for w in (
        "a I am an as at be by do go he if in is it me my no of oh ok on or so to up us we "
        "hi yo ax ox ya id ad"
    ).split()
)
