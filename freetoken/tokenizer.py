"""Tokenizer from a checkpoint's tokenizer.json (HF `tokenizers`), plus its special tokens."""
from __future__ import annotations

import json

from tokenizers import Tokenizer as HFTokenizer

from .errors import FreeTokenError


class Tokenizer:
    def __init__(self, tokenizer_json: bytes, tokenizer_config: dict | None = None,
                 source: str = "tokenizer.json"):
        try:
            self.tk = HFTokenizer.from_str(tokenizer_json.decode())
        except Exception as e:
            raise FreeTokenError(f"{source}: cannot parse tokenizer.json ({e})") from None
        self.config = tokenizer_config or {}
        self.special = {t.content: i for i, t in self.tk.get_added_tokens_decoder().items() if t.special}

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def max_id(self) -> int:
        """The largest id this tokenizer can produce: its vocabulary and its added tokens."""
        ids = self.tk.get_vocab(with_added_tokens=True).values()
        return max(max(ids, default=-1), max(self.tk.get_added_tokens_decoder(), default=-1))

    def check_fits(self, vocab_size: int, source: str) -> None:
        """Every id the tokenizer (and so the chat template) can produce must index a row of the
        model's embedding; a checkpoint may pad vocab_size above the tokenizer (Qwen does)."""
        top = self.max_id()
        if top >= vocab_size:
            raise FreeTokenError(
                f"{source}: the tokenizer produces token ids up to {top}, but the model's vocab_size "
                f"is {vocab_size} (embedding rows 0..{vocab_size - 1}): the tokenizer is not this model's; "
                "copy tokenizer.json and tokenizer_config.json from the model's original release")

    def token_id(self, text: str) -> int | None:
        return self.tk.token_to_id(text)

    def encode(self, text: str) -> list[int]:
        # Qwen adds no BOS; special tokens written in the text are recognised as such.
        # encode_batch, not encode: the same ids, but it lets go of the GIL while it works (encode
        # holds it, so a long prompt tokenized on a worker thread still held the server's event loop)
        return self.tk.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def named_token(self, key: str) -> int | None:
        """Id of tokenizer_config's eos_token / pad_token / ... if it names a token."""
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return self.tk.token_to_id(v) if isinstance(v, str) else None


def load_json(blob: bytes | None, source: str) -> dict:
    if blob is None:
        return {}
    try:
        return json.loads(blob)
    except ValueError as e:
        raise FreeTokenError(f"{source}: invalid JSON ({e})") from None


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte maps to a printable character (the vocabulary of
    byte-level BPE tokenizers such as Qwen's is written in it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
