"""The internal request every API adapter produces, and what the engine streams back.

Plain Python (no torch): the scheduler and the server both use it.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

_ids = itertools.count()


@dataclass
class SamplingOptions:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # strings that end generation (not emitted)
    stop_token_ids: list[int] = field(default_factory=list)  # besides the model's EOS ids
    ignore_eos: bool = False
    # tokens emitted in place of sampled ones (a forced tool-call opening), once `forced_after`
    # has been generated (None: from the first output token)
    forced: list[int] = field(default_factory=list)
    forced_after: int | None = None
    # most likely alternatives reported with each output token (OpenAI top_logprobs; 0: none)
    top_logprobs: int = 0


@dataclass
class Request:
    prompt_ids: list[int]  # rendered prompt, tokenized
    sampling: SamplingOptions
    id: int = field(default_factory=lambda: next(_ids))
    arrival: float = field(default_factory=time.monotonic)
    # engine-side progress (written by the engine thread only)
    slot: int | None = None  # batch row (recurrent-state slot) while running
    computed: int = 0  # tokens of prompt + output whose K/V and recurrent state are in the engine
    prefill_end: int = -1  # tokens to compute before decoding: the prompt (after a preemption:
    #                        the prompt and every token generated so far); -1: len(prompt_ids)
    pages: list[int] = field(default_factory=list)  # KV pages holding tokens [i*P, (i+1)*P)
    shared_pages: int = 0  # leading pages owned by the prefix cache (shared in place, not ours)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # per output token, when sampling.top_logprobs > 0: [(token id, logprob)] most likely first
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    solo: bool = False  # prefill alone (a shared forward it was in failed)
    preemptions: int = 0  # times its state was dropped for lack of KV pages (recomputed later)
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None  # what went wrong, with finish_reason "error"
    cancelled: bool = False  # set by the server when the client goes away
    restored: bool = False  # the prefix cache has been consulted for this request
    cache_node: object = None  # radix node of the reused prefix, held while running
    logits: list = field(default_factory=list)  # logits behind each sampled token (tests only)
    forced_next: int = 0  # how many of sampling.forced have been emitted
    forced_armed: bool = False  # sampling.forced_after has been generated

    def __post_init__(self):
        if self.prefill_end < 0:
            self.prefill_end = len(self.prompt_ids)

    def forcing(self) -> bool:
        """The next output token is a forced one."""
        s = self.sampling
        return self.forced_next < len(s.forced) and (s.forced_after is None or self.forced_armed)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prefill_end

    def token(self, i: int) -> int:
        """Token i of prompt + output."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int = 0, end: int | None = None) -> list[int]:
        """prompt + output [start, end)."""
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def length(self) -> int:
        """Tokens of prompt + output so far."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class TokenEvent:
    """One engine output for one request: new token(s), or the end."""
    request_id: int
    token_ids: list[int]  # new tokens this step (empty on a pure finish event)
    logprobs: list[float]
    finish_reason: str | None = None  # set on the last event
    error: str | None = None
