"""Log-probabilities in OpenAI's shapes: chat `logprobs.content` entries and the legacy
completions `logprobs` object.

A token's text is its own bytes, not a decode of it alone: byte-level BPE splits multi-byte
characters across tokens, and decoding such a piece gives U+FFFD. OpenAI reports those pieces
as `bytes:\\xNN...` with the raw bytes alongside, so a client can join the bytes back.
"""
from __future__ import annotations

from ..runtime.request import SamplingOptions
from ..tokenizer import bytes_to_unicode
from .common import ApiError, field

MAX_TOP = 20  # as OpenAI's top_logprobs


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: vocabulary character -> byte."""
    return {c: b for b, c in bytes_to_unicode().items()}


class TokenText:
    """Token id -> (text as OpenAI shows it, raw bytes), memoized."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        hf = tokenizer.tk
        self.added = {i: t.content for i, t in hf.get_added_tokens_decoder().items()}
        self.byte_level = type(hf.decoder).__name__ == "ByteLevel"
        self.bytes_of = _byte_decoder()
        self.memo: dict[int, tuple[str, bytes]] = {}

    def __call__(self, tid: int) -> tuple[str, bytes]:
        got = self.memo.get(tid)
        if got is None:
            got = self.memo[tid] = self._compute(tid)
        return got

    def _compute(self, tid: int) -> tuple[str, bytes]:
        piece = self.tok.tk.id_to_token(tid)
        if tid in self.added or piece is None:
            raw = (self.added.get(tid) or self.tok.decode([tid])).encode()
        elif self.byte_level and all(c in self.bytes_of for c in piece):
            raw = bytes(self.bytes_of[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            raw = bytes([int(piece[3:5], 16)])
        else:
            raw = self.tok.decode([tid]).encode()
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:  # part of a character
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def chat_options(body: dict, sampling: SamplingOptions) -> bool:
    """Chat `logprobs` / `top_logprobs` -> whether to report them (and how many alternatives)."""
    want = bool(field(body, "logprobs", "boolean", False))
    top = field(body, "top_logprobs", "integer")
    if top is not None:
        if top and not want:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        sampling.top_logprobs = _check_top(top, "top_logprobs") if want else 0
    return want


def completion_options(body: dict, sampling: SamplingOptions) -> bool:
    """Legacy completions `logprobs: N` (the N most likely alternatives per token)."""
    n = field(body, "logprobs", "integer")
    if n is None:
        return False
    sampling.top_logprobs = _check_top(n, "logprobs")
    return True


def _check_top(n: int, name: str) -> int:
    if not 0 <= n <= MAX_TOP:
        raise ApiError(400, f"{name} must be in [0, {MAX_TOP}], got {n}", param=name)
    return n


def chat_entries(text: TokenText, ids, lps, tops) -> list[dict]:
    """`choices[].logprobs.content`: one entry per output token."""
    def entry(tid: int, lp: float) -> dict:
        s, raw = text(tid)
        return {"token": s, "logprob": lp, "bytes": list(raw)}
    return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
            for t, lp, top in zip(ids, lps, tops)]


def completion_logprobs(text: TokenText, ids, lps, tops, offsets) -> dict:
    """Legacy completions `logprobs`: the N most likely tokens and the chosen one, so up to
    N + 1 entries per dict (as OpenAI documents it)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": list(offsets)}
    for t, lp, top in zip(ids, lps, tops):
        s = text(t)[0]
        alts: dict[str, float] = {}
        for a, alp in [*top, (t, lp)]:
            alts.setdefault(text(a)[0], alp)  # two ids with one spelling: keep the likelier
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(alts)
    return out
