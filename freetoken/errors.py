"""User-facing errors: the CLI prints these as one line, without a traceback.

Also `notice()`: the one-line messages FreeToken prints on stderr for things the user should
know about while they happen (a first-run step that takes a while, a cache file rebuilt).
"""
import sys


class FreeTokenError(Exception):
    """A problem with the user's input (a file, a flag, a prompt), not a bug in FreeToken.

    The message names what is wrong and, where it helps, what to do about it.
    """


class CorruptModelError(FreeTokenError):
    """An FTW file that is truncated, has a bad header or fails a block checksum."""


class BankLayoutError(CorruptModelError, ValueError):
    """Quantized expert tensors whose shapes do not fit together (a scale bank that does not
    match its values): refused when the bank is made, one line from the CLI."""


class UnsupportedModelError(FreeTokenError):
    """A checkpoint whose architecture or options FreeToken does not implement."""


class ContextOverflowError(FreeTokenError):
    """A prompt (plus the requested new tokens) longer than the model's context."""


def notice(message: str) -> None:
    """One line on stderr, prefixed like the CLI's errors (`ft: ...`), flushed at once."""
    print(f"ft: {message}", file=sys.stderr, flush=True)
