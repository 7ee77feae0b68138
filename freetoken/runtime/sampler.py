"""Batched sampling: greedy at temperature 0, else temperature / min-p / top-k / top-p.

Log-probabilities are those of the model's own distribution (log_softmax of raw logits),
as OpenAI-style `logprobs` report them, also where penalties or a logit bias moved the pick
(runtime/penalties.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    min_p: float = 0.0  # tokens below min_p x the most likely one's probability are cut; 0: none

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None, top_n: int = 0,
           norm: float | None = None, adjusted: torch.Tensor | None = None):
    """logits: [V] float -> (token id, its log-probability under the model, the top_n most
    likely [(id, logprob)], most likely first; [] when top_n is 0). norm: the model's
    log-normalizer when the logits were masked (constrained decoding: -inf where forbidden), so
    log-probabilities stay the model's. adjusted: [V] the logits the pick reads instead (the
    request's penalties and bias applied); the log-probabilities still come from `logits`."""
    logprobs = logits.float() - norm if norm is not None else torch.log_softmax(logits.float(), dim=-1)
    choose = logits if adjusted is None else adjusted
    if params.temperature == 0:
        tok = int(torch.argmax(choose))
    else:
        tok = _draw(choose, params, gen)
    return tok, float(logprobs[tok]), top_entries(logprobs, top_n)


def _draw(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    scaled = logits.float() / params.temperature
    if params.min_p > 0:  # relative to the most likely token, after temperature (as vLLM)
        p = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(p < params.min_p * p.max(), float("-inf"))  # the most likely always stays
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = sp.cumsum(0) - sp < params.top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def top_entries(logprobs: torch.Tensor, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens of a [V] log-probability vector, most likely first."""
    if n <= 0:
        return []
    v, i = torch.topk(logprobs, min(n, logprobs.numel()))
    # tokens a grammar masked out (-inf) are no alternatives
    return [(a, b) for a, b in zip(i.tolist(), v.tolist()) if b != float("-inf")]


def greedy_rows(logits: torch.Tensor, rows: list[int], top_n: int = 0, norm: torch.Tensor | None = None,
                norm_rows: list[int] | None = None):
    """Greedy picks for `rows` of logits [B, V], computed where the logits are (one batched
    argmax and log_softmax on the GPU) so only a few numbers per row cross to the host, in one
    transfer. -> [(token id, logprob, top_n most likely [(id, logprob)])] per row.
    norm: the model's log-normalizers [len(norm_rows)] (on the logits' device) of the rows whose
    logits a grammar masked, norm_rows their positions in `rows`: log-probabilities stay the
    model's (the masked rows' own normalizer would inflate them)."""
    return parse_greedy(greedy_packed(logits, rows, top_n, norm, norm_rows).tolist())  # the one sync


def greedy_packed(logits: torch.Tensor, rows: list[int], top_n: int = 0, norm: torch.Tensor | None = None,
                  norm_rows: list[int] | None = None) -> torch.Tensor:
    """greedy_rows' device part: [R, 2 (+ 2 top_n)] float64 on the logits' device (token id,
    logprob, then the top_n ids and logprobs), for the caller to bring over when it chooses
    (the serving loop's deferred decode steps copy it without waiting: runtime/loop.py)."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        sel = logits[rows[0]:rows[0] + len(rows)].float()  # [R, V] a view: no index upload
    else:
        sel = logits[torch.tensor(rows, device=logits.device)].float()
    if norm is None:
        lsm = torch.log_softmax(sel, -1)  # [R, V]
    elif len(norm_rows) == len(rows):  # every row masked: one pass
        lsm = sel - norm.unsqueeze(1)
    else:
        lsm = torch.log_softmax(sel, -1)
        at = torch.tensor(norm_rows, device=sel.device)
        lsm[at] = sel[at] - norm.unsqueeze(1)
    tok = sel.argmax(-1, keepdim=True)  # [R, 1]
    parts = [tok.double(), lsm.gather(1, tok).double()]  # ids < 2^53 are exact in float64
    if top_n > 0:
        v, i = torch.topk(lsm, min(top_n, lsm.shape[1]), dim=-1)  # [R, n]
        parts += [i.double(), v.double()]
    return torch.cat(parts, 1)  # [R, 2 (+ 2n)]


def parse_greedy(host: list[list[float]]) -> list[tuple]:
    """greedy_packed's rows, on the host, as [(token id, logprob, [(id, logprob)])]."""
    out = []
    for row in host:
        n = (len(row) - 2) // 2
        tops = [(int(a), b) for a, b in zip(row[2:2 + n], row[2 + n:]) if b != float("-inf")]  # masked: none
        out.append((int(row[0]), row[1], tops))
    return out
