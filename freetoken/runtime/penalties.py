"""Per-request logit adjustments before a token is picked: OpenAI's logit_bias and presence /
frequency penalties, and the repetition penalty of transformers and vLLM.

In the order vLLM applies them, on the row's logits (the model's, or a grammar's masked ones):
  logit_bias          x[t] += bias[t]
  repetition_penalty  for every token t of the prompt or the output so far:
                      x[t] = x[t] / p if x[t] > 0 else x[t] * p   (p > 1 discourages)
  frequency_penalty   x[t] -= f * c[t]             c[t]: times t was generated so far
  presence_penalty    x[t] -= q * (c[t] > 0)
  min_tokens          x[t] = -inf for the EOS ids and stop_token_ids while fewer than
                      min_tokens tokens have been generated (vLLM's)
Then temperature, min-p, top-k and top-p pick from the result (runtime/sampler.py); greedy
takes its argmax. The log-probabilities reported stay the model's own (before these
adjustments), as vLLM reports them by default.

A request that sets any of them is picked on the host (its row's logits come over), not by
the device's batched argmax: the counts live here, per request.
"""
from __future__ import annotations

from collections import Counter

import torch


# the values each penalty may take (where ft generate's flags and the API check them), and its
# neutral value: OpenAI's range for presence and frequency; far below 0.01 a logit divided by
# the repetition penalty overflows float32
RANGES = {"presence_penalty": (-2.0, 2.0, 0.0), "frequency_penalty": (-2.0, 2.0, 0.0),
          "repetition_penalty": (0.01, 100.0, 1.0)}


def out_of_range(name: str, value: float) -> str | None:
    """None if `value` is one penalty `name` may take, else what the range is ("in [-2, 2]")."""
    lo, hi, off = RANGES[name]
    return None if lo <= value <= hi else f"in [{lo:g}, {hi:g}] ({off:g}: none)"


class LogitAdjuster:
    """The adjustments of one request. opts: its SamplingOptions; prompt_ids: the prompt (read
    by the repetition penalty); output_ids: what it has generated so far (a request preempted
    and resumed, or one whose state is built after forced tokens, counts those too)."""

    def __init__(self, opts, prompt_ids: list[int], output_ids: list[int] = (), eos_ids=()):
        """eos_ids: the model's end-of-sequence ids (what min_tokens holds back, with the
        request's stop_token_ids; ignore_eos requests never stop on them anyway)."""
        self.opts = opts
        self.counts = Counter(output_ids)
        self.generated = len(output_ids)
        ends = set(opts.stop_token_ids) | (set() if opts.ignore_eos else set(eos_ids))
        self._ends = torch.tensor(sorted(ends), dtype=torch.long) if opts.min_tokens and ends else None
        self._prompt_seen = None  # the prompt's distinct ids [P'] (repetition penalty), made once
        self._prompt = prompt_ids if opts.repetition_penalty != 1.0 else None
        bias = sorted(opts.logit_bias.items())
        self._bias = (torch.tensor([t for t, _ in bias], dtype=torch.long),
                      torch.tensor([b for _, b in bias], dtype=torch.float32)) if bias else None

    def update(self, tok: int) -> None:
        """The request emitted `tok`."""
        self.counts[tok] += 1
        self.generated += 1

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> the adjusted logits [V] float32 (a new tensor; the input is unchanged)."""
        o = self.opts
        x = logits.float().clone()  # [V]
        v = x.shape[0]
        dev = x.device
        if self._bias is not None:
            ids, vals = self._bias
            keep = ids < v  # the server checked ids against the vocabulary; the head may be padded past it
            x.index_add_(0, ids[keep].to(dev), vals[keep].to(dev))
        if o.repetition_penalty != 1.0:
            if self._prompt_seen is None:
                self._prompt_seen = torch.unique(torch.tensor(self._prompt, dtype=torch.long))
            seen = self._prompt_seen
            if self.counts:
                seen = torch.unique(torch.cat([seen, torch.tensor(list(self.counts), dtype=torch.long)]))
            seen = seen[seen < v].to(dev)  # [S]
            s = x[seen]
            x[seen] = torch.where(s > 0, s / o.repetition_penalty, s * o.repetition_penalty)
        if self.counts and (o.frequency_penalty or o.presence_penalty):
            ids = torch.tensor(list(self.counts), dtype=torch.long)  # [D] distinct generated ids
            c = torch.tensor(list(self.counts.values()), dtype=torch.float32)  # [D] their counts
            keep = ids < v
            x.index_add_(0, ids[keep].to(dev), -(o.frequency_penalty * c[keep] + o.presence_penalty).to(dev))
        if self._ends is not None and self.generated < o.min_tokens:
            ends = self._ends[self._ends < v].to(dev)
            x[ends] = float("-inf")
        return x
