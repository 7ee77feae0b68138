"""User-facing errors: the CLI prints these as one line, without a traceback."""


class FreeTokenError(Exception):
    """A problem with the user's input (a file, a flag, a prompt), not a bug in FreeToken.

    The message names what is wrong and, where it helps, what to do about it.
    """


class CorruptModelError(FreeTokenError):
    """An FTW file that is truncated, has a bad header or fails a block checksum."""


class UnsupportedModelError(FreeTokenError):
    """A checkpoint whose architecture or options FreeToken does not implement."""


class ContextOverflowError(FreeTokenError):
    """A prompt (plus the requested new tokens) longer than the model's context."""
