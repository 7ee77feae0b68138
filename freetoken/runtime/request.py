"""The internal request every API adapter produces, and what the engine streams back.

Plain Python (no torch): the scheduler and the server both use it.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict, dataclass, field

_ids = itertools.count()


@dataclass(frozen=True)
class ToolSchema:
    """A tool a constrained call may name, with the JSON schema of its arguments."""
    name: str
    parameters: dict  # JSON schema of the arguments (an object)
    strict: bool = True  # schema keywords the engine cannot enforce are an error (False: ignored)


@dataclass(frozen=True)
class CallSyntax:
    r"""How the chat template writes one tool call, as literal pieces (probed from the template by
    server.tool_choice). json: HEAD name TAIL ARGS arguments-object CLOSE, e.g.
    `<tool_call>\n{"name": "` X `"` `, "arguments": ` {...} `}\n</tool_call>`; xml: HEAD name TAIL
    (PARAM key MID value END_PARAM)* CLOSE, e.g. `<tool_call>\n<function=` X `>`
    `\n<parameter=` k `>\n` v `\n</parameter>` `\n</function>\n</tool_call>`."""
    style: str  # "json" | "xml"
    head: str
    tail: str
    close: str
    args: str = ""  # json: between the name's tail and the arguments object
    param: str = ""  # xml: before a parameter's name
    mid: str = ""  # xml: between a parameter's name and its value
    end_param: str = ""  # xml: after a parameter's value
    sep: str = "\n"  # between two calls


@dataclass(frozen=True)
class GrammarSpec:
    """What constrained decoding must produce (runtime.grammar compiles it).

    kind: "json_object" (any JSON object), "json_schema" (`schema`; `strict` refuses schema
    keywords the engine cannot enforce, otherwise they are ignored), "regex" (`pattern`), or
    "tool_call": `lead` then one call (several with `multiple`) to one of `tools` in the
    template's `syntax`, or, with `text`, free text in which every call that opens follows its
    tool's schema. The grammar applies from the first output token, or from the token after
    `after` (the end of thinking) when that is set."""
    kind: str
    schema: dict | None = None
    strict: bool = False
    pattern: str | None = None
    tools: tuple[ToolSchema, ...] = ()
    syntax: CallSyntax | None = None
    lead: str = ""
    text: bool = False
    multiple: bool = False
    after: int | None = None

    def key(self) -> str:
        """Identity of the compiled grammar (`after` is not part of it)."""
        d = asdict(self)
        d.pop("after")
        return json.dumps(d, sort_keys=True, ensure_ascii=False, default=str)


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
    # min-p: tokens below min_p x the most likely one's probability are cut (0: none)
    min_p: float = 0.0
    # logit adjustments before the pick (runtime/penalties.py): OpenAI's presence and frequency
    # penalties and logit_bias {token id: bias}, and the repetition penalty (1: none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's min_tokens: the EOS ids and stop_token_ids cannot be picked before this many
    # output tokens (0: no floor)
    min_tokens: int = 0
    # constrained decoding: what the output (from grammar.after on) must match; None: free
    grammar: GrammarSpec | None = None

    def adjusts_logits(self, generated: int = 0) -> bool:
        """Whether logits are adjusted before the pick (penalties, a bias, a floor on the
        output's length, while `generated` output tokens are fewer): such a request's
        tokens are picked on the host, where its counts are."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or generated < self.min_tokens)


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
    grammar: object = None  # the engine's matcher state when sampling.grammar is set (runtime.grammar)
    adjuster: object = None  # runtime.penalties.LogitAdjuster when sampling.adjusts_logits()

    def __post_init__(self):
        if self.prefill_end < 0:
            self.prefill_end = len(self.prompt_ids)

    def picked_on_device(self) -> bool:
        """Greedy with nothing to adjust on the host: the device's batched argmax picks it."""
        return (self.sampling.temperature == 0 and not self.forcing()
                and not self.sampling.adjusts_logits(len(self.output_ids)))

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
