"""A checkpoint's chat template as a chat transcript uses it: messages checked, conversations rendered and
tokenized, and the checks that one rendering extends another (no session, no engine calls).

`ChatTranscript` (engine/chat.py) keeps a conversation on a session; this module is its template half:
- `check_message`: a message is exactly {role (one of ROLES), content (a string)};
- `ChatTemplate.render` / `encode`: the whole conversation's text, and template text -> ids (special tokens
  written in it become their ids; none added);
- `ChatTemplate.extension`: what a longer rendering adds to a shorter one, or `TemplateNotIncrementalError`
  when it rewrites it (such a template cannot be appended to a persistent session);
- `ChatTemplate.end_of_turn_ids`: the special token that closes an assistant turn, found by rendering a probe;
- `ChatTemplate.agreeing`: how much of a generated reply's tokens the re-rendered conversation keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from streamserve.config import SAMPLING_DEFAULTS as SD
from streamserve.engine.sampling import check_sampling, check_seed, check_stop
from streamserve.errors import ChatTemplateError, InvalidInputError
from streamserve.models.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant", "tool")
Message = dict[str, str]
REPLY_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids")


class NoChatTemplateError(ChatTemplateError):
    code = "no_chat_template"  # the model has no chat template: chat is refused (plain appends still work)


class TemplateNotIncrementalError(ChatTemplateError):
    code = "chat_template_not_incremental"  # rendering a longer conversation does not extend the shorter one's


class ChatMessageError(InvalidInputError):
    code = "invalid_chat_message"  # not {"role": one of ROLES, "content": str}


def check_role(role: Any) -> str:
    if role not in ROLES:
        raise ChatMessageError(f"a chat message's role must be one of {list(ROLES)}, got {role!r}")
    return str(role)


def check_message(message: Any) -> Message:
    """A chat message, checked: a map of exactly `role` (one of ROLES) and `content` (a string)."""
    if not isinstance(message, Mapping):
        raise ChatMessageError(f"a chat message is a map {{role, content}}, got {type(message).__name__}")
    extra = sorted(str(k) for k in message if k not in ("role", "content"))
    if extra:
        raise ChatMessageError(f"a chat message has only 'role' and 'content'; remove {extra}")
    role, content = check_role(message.get("role")), message.get("content")
    if not isinstance(content, str):
        raise ChatMessageError(f"a chat message's content must be a string, got {type(content).__name__}")
    return {"role": role, "content": content}


def check_reply_params(sampling: Mapping[str, Any]) -> None:
    """A reply's parameters, checked before its generation prompt is appended (a refused reply changes nothing)."""
    if unknown := sorted(set(sampling) - set(REPLY_PARAMS)):
        raise InvalidInputError(f"unknown reply parameter(s) {unknown}")
    check_sampling(sampling.get("max_tokens", SD.max_tokens), sampling.get("temperature", SD.temperature),
                   sampling.get("top_p", SD.top_p), sampling.get("top_k", SD.top_k))
    check_seed(sampling.get("seed")), check_stop(sampling.get("stop"))


@dataclass(frozen=True)
class Turn:
    """One planned append: `ids` (the pending end of the last turn, then the new text), `start` (where the new
    messages' rendering begins in the session), `rendered` (the text once in)."""

    ids: list[int]
    start: int
    rendered: str
    messages: tuple[Message, ...]  # none: a generation prompt


class ChatTemplate:
    """The tokenizer's chat template: renderings of whole conversations and their tokens."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[Message], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Template text -> ids: special tokens written in it become their ids; none are added."""
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> their text, special tokens written out (the inverse of `encode` on template text)."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @staticmethod
    def extension(longer: str, shorter: str, what: str) -> str:
        """The text `longer` adds to `shorter`, which it must extend (`what`: the addition, for the error)."""
        if not longer.startswith(shorter):
            raise TemplateNotIncrementalError(
                f"this model's chat template is not incremental: rendering the conversation with {what} changes "
                "the text of the turns before it (the template rewrites history), so it cannot be appended to a "
                "persistent session; use a template whose renderings extend each other, or `streamserve generate`")
        return longer[len(shorter):]

    def end_of_turn_ids(self) -> tuple[int, ...]:
        """The special token closing an assistant turn (ChatML's <|im_end|>, Gemma's <end_of_turn>), found by
        rendering a probe exchange: replies stop there even where the model's EOS is another token."""
        probe: list[Message] = [{"role": "user", "content": "x"}]
        try:
            head = self.render(probe, True)
            full = self.render([*probe, {"role": "assistant", "content": "y"}])
        except ChatTemplateError:
            return ()
        tail = full[len(head):] if full.startswith(head) else ""
        ids = self.encode(tail[tail.find("y") + 1:]) if "y" in tail else []
        special = bool(ids) and self.tokenizer.decode(ids[:1], skip_special_tokens=True) == ""
        return (ids[0],) if special else ()

    def agreeing(self, ids: list[int], tail: str) -> tuple[int, str]:
        """The longest prefix of the generated `ids` whose text begins `tail`, ended early by an id the tokenizer
        cannot write or by bytes that are not UTF-8 (their text, U+FFFD, would not tokenize back to them):
        -> (its length, its text). One streaming pass, then one decode to check (rarely a step back)."""
        detok, shown, k = self.tokenizer.detokenizer(skip_special_tokens=False), 0, 0
        for i, t in enumerate(ids):
            if self.decode([t]) == "":
                break
            piece = detok.push([t])  # "" while a character is incomplete
            if piece and ("\ufffd" in piece or not tail.startswith(piece, shown)):
                break
            if piece:
                shown, k = shown + len(piece), i + 1
        while k > 0:
            text = self.decode(ids[:k])
            if tail.startswith(text) and "\ufffd" not in text:
                return k, text
            k -= 1
        return 0, ""

    def text_after(self, ids: Sequence[int], start: int) -> str:
        """The text of `ids[start:]` as it reads after `ids[:start]` (a few ids before it decoded with it, for
        decoders that read context, such as SentencePiece's leading-space rule)."""
        # (the detokenizer reads the last few context ids: an endless session keeps only its recent ones)
        detok = self.tokenizer.detokenizer(skip_special_tokens=False, context=ids[max(0, start - 8):start])
        return detok.push(ids[start:]) + detok.flush()
