"""Semantic turn detection: how much silence ends a turn, from the words said so far (OpenAI's `semantic_vad`).

A documented rule set over the streaming transcript (no model ships on the package index for it): the silence that
ends the turn is short when the words form a complete sentence or question, long when they trail off ("and…",
"so I think"), and in between otherwise. `eagerness` scales all three, as the Realtime API's field does: "high"
ends turns soonest, "low" lets the person take their time, "auto" is "medium"; the trailing case waits up to the
API's documented maximum (2, 4 and 8 s).

    complete  ends in . ? or ! and the last word is no trailing word       -> SILENCE_MS[eagerness][0]
    open      anything else (no final punctuation yet, or no words)       -> SILENCE_MS[eagerness][1]
    trailing  the last word or two leave the sentence hanging, or , ; : … -> SILENCE_MS[eagerness][2]
Whisper punctuates what it hears, fragments too ("I went to the market and."): a trailing word wins over a period.
"""

from __future__ import annotations

import re

EAGERNESS = ("low", "medium", "high", "auto")
# eagerness -> silence (ms) that ends a turn that is (complete, open, trailing)
SILENCE_MS = {"high": (200, 500, 2000), "medium": (300, 800, 4000), "low": (600, 1500, 8000)}
SILENCE_MS["auto"] = SILENCE_MS["medium"]
# words after which an English sentence cannot end: conjunctions, articles, prepositions, fillers, subjects
TRAILING_WORDS = frozenset("""
    and or but so because since although though unless until while whereas if then than that which who whom whose
    where when whether the a an this these those my your his her its our their some any every no to of in on at by
    for with from into onto about like as um uh er erm hmm mm well also plus is are was were am be been being have
    has had do does did can could would should will shall may might must i we you he she they it i'm i've i'd we're
""".split())
TRAILING_PHRASES = frozenset({("i", "think"), ("i", "mean"), ("i", "guess"), ("you", "know"), ("kind", "of"),
                               ("sort", "of"), ("i", "want"), ("i", "was"), ("let", "me"), ("i", "would")})
_WORD = re.compile(r"[a-z']+")


def turn_state(text: str) -> str:
    """"complete", "open" or "trailing": how the words said so far end (see the module's table)."""
    stripped = text.strip().rstrip("\"')]}»”’").rstrip()
    words = _WORD.findall(stripped.lower())
    if not words:
        return "open"
    if stripped.endswith(("...", "…", ",", ";", ":", "-", "—")):
        return "trailing"
    if words[-1] in TRAILING_WORDS or tuple(words[-2:]) in TRAILING_PHRASES:
        return "trailing"
    return "complete" if stripped.endswith((".", "?", "!")) else "open"


def turn_silence_ms(text: str, eagerness: str) -> int:
    """The silence (ms) that ends a turn whose words so far are `text`, at `eagerness`."""
    complete, open_, trailing = SILENCE_MS[eagerness]
    return {"complete": complete, "open": open_, "trailing": trailing}[turn_state(text)]
