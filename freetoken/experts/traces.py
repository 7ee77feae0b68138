"""Decode-time MoE routing traces: readers, a synthetic generator, and one representation.

A trace is what the router chose, replayed without the model: for the expert cache policy
simulator (`bench/policy_sim.py`) and for the expert cache benchmark's `--routing` option
(`parse_routing`). Plain Python and numpy; no torch.

Representation
--------------
`RoutingTrace` holds one or more `RoutedSequence`s (one per request: a dataset problem, a CSV
file, a synthetic stream) of one model shape: `num_layers` MoE layers, `num_experts` routed
experts per layer, `top_k` experts per token. A sequence's decode routing is an int32 array
`experts[T, L, k]`: the top-k expert ids of its t-th generated token at MoE layer l, in the
router's order (highest gate first where the source says so), `-1` where the source has no
record for that (token, layer) (see the notes of each reader). Its gate weights, when the
source has them, are `gates[T, L, k]` (float32, NaN where missing): they are kept because a
cache policy may use them. Where the source recorded the prompt's routing too (the raw vLLM
format, the synthetic generator), `prefill_experts[P, L, k]` / `prefill_gates` hold it; it is
not part of the decode steps.

`RoutingTrace.decode_steps(batch)` yields the decode steps: each an int32 array `[L, b, k]`
(index it by layer to get each token's top-k ids), b = 1 for a single sequence; with
`batch=B`, B sequences decode together (continuous batching: when one ends, the next waiting
sequence takes its row), so b <= B.

Formats
-------
jsonl (the formats of `../shared/traces/`, Mixtral-8x7B recorded by a patched vLLM): one
JSON object per line with `layer`, `experts` (list of ids), optional `gating_probs` (same
length), optional `dataset` and `problem_id` (they name the sequence; records are grouped by
the pair, each group one sequence, groups in order of first appearance), and one of:

- `token_idx` (the post-processed files `*_N_routing.jsonl`): the index of the generated
  token. Decode step t is token_idx t, layers in order. Caveat of the producer (its
  `process_raw_data`): it dropped records whose gates were exactly [0.5, 0.5] (a filter meant
  for padding rows) and then numbered the surviving records of each layer 0, 1, 2, ...
  separately, so after such a drop a layer's later tokens are shifted by one against the
  other layers and the last token(s) have fewer than L layers. That cannot be undone here:
  the routes are kept as numbered, a missing (token, layer) is -1, and `notes` counts them.
- `token_pos` (the raw profiler output `routing_raw.jsonl`): the row within the forward
  pass's batch, not a sequence position. Records come in execution order: every forward pass
  is layer 0, 1, ..., L-1, each layer with one record per row. Passes are split where the
  layer number goes down (or repeats with token_pos not increasing); a pass with any
  token_pos > 0 is a prompt (prefill) pass, a pass whose rows are all token_pos 0 is one
  decode step. Prefill passes before the first decode step are the sequence's prefill
  (`prefill_experts`); a prefill pass after decode began starts a new sequence (named
  `<dataset>/<problem_id>#2`, ...). Layers absent from a decode pass (the same [0.5, 0.5]
  filter) are -1: here the alignment across layers is exact.

CSV (`csv:PATH`, or `trace:PATH` with a `.csv` name): one sequence, one row per (layer, token)::

    layer,token,e0,e1,...,e{k-1}[,g0,g1,...,g{k-1}]

- `layer` and `token` are integers >= 0 (MoE layer index, generated-token index); `e0..`
  are the k routed expert ids (integers in [0, num_experts)), in the router's order; k is the
  number of `e` columns and is the same on every row.
- The header line is optional. Without it every row has exactly 2 + k integer fields. Gate
  weight columns `g0..g{k-1}` (floats) are allowed only with a header that names them.
- Blank lines and lines starting with `#` are ignored; rows may come in any order; a (layer,
  token) pair given twice is an error; a (token, layer) with no row is -1 (not recorded).
- Example (2 layers, top-2)::

      layer,token,e0,e1
      0,0,3,7
      1,0,1,4
      0,1,3,5
      1,1,0,4

Synthetic (`synthetic:layers=40,experts=256,k=8,skew=1.1,steps=2000,seed=0`): SYNTHETIC
routing, not recorded from any model; every trace it makes has `synthetic=True` and a name
starting with "SYNTHETIC". Per layer a Zipf-skewed popularity (expert of rank r has weight
r^-skew, ranks a random permutation per layer), a per-sequence deviation from it that drifts
slowly (an Ornstein-Uhlenbeck process in logit space: stationary std `drift` nats, correlation
time `tau` steps), and temporal locality (the previous token's experts at the same layer get
`stick` nats more). Each token draws k distinct experts per layer by Gumbel-top-k on those
logits (sampling without replacement in proportion to exp(logit)); its gates are the softmax
of the k perturbed logits. `prefill` prompt tokens are drawn first from the same process and
stored as the prefill. Keys: layers, experts, k, steps, skew, seed, sequences, prefill,
drift, tau, stick. The defaults are plausible guesses, not fitted to any model's routing.

Errors are one line (`FreeTokenError`), naming the file and line.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
from typing import Iterator

import numpy as np

from freetoken.errors import FreeTokenError

__all__ = ["RoutedSequence", "RoutingTrace", "load_jsonl", "load_csv", "synthetic_trace",
           "parse_routing", "merge_traces", "SYNTHETIC_DEFAULTS"]


@dataclasses.dataclass
class RoutedSequence:
    """One request's routing: `experts[T, L, k]` int32 (-1: not recorded), `gates` alike."""
    name: str
    experts: np.ndarray
    gates: np.ndarray | None = None
    prefill_experts: np.ndarray | None = None
    prefill_gates: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        return int(self.experts.shape[0])

    def step(self, t: int) -> np.ndarray:
        """Decode step t: `[L, 1, k]` (per layer, the one token's top-k ids)."""
        return self.experts[t][:, None, :]


@dataclasses.dataclass
class RoutingTrace:
    """Decode-time routing of one or more sequences of one model shape (see module doc)."""
    name: str
    num_layers: int
    num_experts: int
    top_k: int
    sequences: list[RoutedSequence]
    source: str = ""
    synthetic: bool = False
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_steps for s in self.sequences)

    @property
    def has_gates(self) -> bool:
        return all(s.gates is not None for s in self.sequences)

    def missing_routes(self) -> int:
        """(token, layer) pairs of the decode steps with no record."""
        return int(sum((s.experts[:, :, 0] < 0).sum() for s in self.sequences))

    def decode_steps(self, batch: int = 1, with_gates: bool = False) -> Iterator:
        """Yield the decode steps, each `[L, b, k]` int32 (b <= batch active sequences).

        Continuous batching: `batch` rows; a sequence occupies one row from its first to its
        last token; when it ends, the next sequence (in order) takes the row at the next step.
        With `with_gates`, yield `(experts, gates)` (gates NaN where unknown)."""
        if batch < 1:
            raise FreeTokenError(f"batch must be >= 1, not {batch}")
        waiting = list(range(len(self.sequences)))[::-1]
        rows: list[list[int]] = []  # [sequence index, next token]
        L, k = self.num_layers, self.top_k
        while True:
            rows = [r for r in rows if r[1] < self.sequences[r[0]].num_steps]
            while len(rows) < batch and waiting:
                i = waiting.pop()
                if self.sequences[i].num_steps:
                    rows.append([i, 0])
            if not rows:
                return
            ex = np.empty((L, len(rows), k), np.int32)
            gt = np.full((L, len(rows), k), np.nan, np.float32) if with_gates else None
            for j, (i, t) in enumerate(rows):
                s = self.sequences[i]
                ex[:, j, :] = s.experts[t]
                if with_gates and s.gates is not None:
                    gt[:, j, :] = s.gates[t]
            for r in rows:
                r[1] += 1
            yield (ex, gt) if with_gates else ex

    def step_admissions(self, batch: int = 1) -> list[list[int]]:
        """For each decode step of `decode_steps(batch)`, the sequences that start there."""
        out: list[list[int]] = []
        waiting = list(range(len(self.sequences)))[::-1]
        rows: list[list[int]] = []
        while True:
            rows = [r for r in rows if r[1] < self.sequences[r[0]].num_steps]
            started = []
            while len(rows) < batch and waiting:
                i = waiting.pop()
                if self.sequences[i].num_steps:
                    rows.append([i, 0])
                    started.append(i)
            if not rows:
                return out
            out.append(started)
            for r in rows:
                r[1] += 1

    def summary(self) -> dict:
        return {"name": self.name, "source": self.source, "synthetic": self.synthetic,
                "layers": self.num_layers, "experts_per_layer": self.num_experts,
                "top_k": self.top_k, "sequences": len(self.sequences),
                "decode_tokens": self.num_tokens,
                "prefill_tokens": sum(0 if s.prefill_experts is None else len(s.prefill_experts)
                                      for s in self.sequences),
                "missing_routes": self.missing_routes(), "gates": self.has_gates,
                "notes": list(self.notes)}


# ---------------------------------------------------------------------------------------------
# helpers

def _err(path: str, line: int | None, msg: str) -> FreeTokenError:
    where = f"{path}:{line}" if line is not None else path
    return FreeTokenError(f"routing trace {where}: {msg}")


def _open_text(path: str):
    if not os.path.exists(path):
        raise FreeTokenError(f"routing trace {path}: no such file")
    if os.path.isdir(path):
        raise FreeTokenError(f"routing trace {path}: is a directory, not a trace file")
    try:
        return open(path, encoding="utf-8")
    except OSError as e:
        raise FreeTokenError(f"routing trace {path}: cannot read ({e.strerror})") from None


def _as_int(v, path, line, field) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(path, line, f"'{field}' must be an integer, got {json.dumps(v)}")
    if v < 0:
        raise _err(path, line, f"'{field}' must be >= 0, got {v}")
    return v


def _finish_shape(path, max_layer, max_expert, k, num_layers, num_experts, top_k):
    L = max_layer + 1 if num_layers is None else num_layers
    E = max_expert + 1 if num_experts is None else num_experts
    if num_layers is not None and max_layer >= num_layers:
        raise _err(path, None, f"layer {max_layer} out of range for {num_layers} MoE layers")
    if num_experts is not None and max_expert >= num_experts:
        raise _err(path, None, f"expert id {max_expert} out of range for {num_experts} experts")
    if top_k is not None and k != top_k:
        raise _err(path, None, f"records route to {k} experts, expected top_k={top_k}")
    return L, E


def _dense(tokens: dict, L: int, k: int, with_gates: bool):
    """{(t, layer): (experts, gates)} -> experts[T, L, k], gates[T, L, k] (-1 / NaN holes)."""
    T = 1 + max((t for t, _ in tokens), default=-1)
    ex = np.full((T, L, k), -1, np.int32)
    gt = np.full((T, L, k), np.nan, np.float32) if with_gates else None
    for (t, layer), (e, g) in tokens.items():
        ex[t, layer] = e
        if with_gates and g is not None:
            gt[t, layer] = g
    return ex, gt


# ---------------------------------------------------------------------------------------------
# jsonl

def load_jsonl(path: str, *, num_layers: int | None = None, num_experts: int | None = None,
               top_k: int | None = None) -> RoutingTrace:
    """Read a routing jsonl file (either record format of ../shared/traces; module doc)."""
    groups: dict[tuple, dict] = {}
    k = None
    max_layer = max_expert = -1
    any_gates = False
    with _open_text(path) as f:
        for n, raw in enumerate(f, 1):
            s = raw.strip()
            if not s:
                continue
            try:
                r = json.loads(s)
            except json.JSONDecodeError as e:
                raise _err(path, n, f"not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(r, dict):
                raise _err(path, n, "a record must be a JSON object")
            if "layer" not in r or "experts" not in r:
                miss = [x for x in ("layer", "experts") if x not in r]
                raise _err(path, n, f"record lacks {' and '.join(repr(x) for x in miss)}")
            if "token_idx" in r and "token_pos" in r:
                raise _err(path, n, "record has both 'token_idx' and 'token_pos'")
            if "token_idx" in r:
                fmt, tok = "idx", _as_int(r["token_idx"], path, n, "token_idx")
            elif "token_pos" in r:
                fmt, tok = "pos", _as_int(r["token_pos"], path, n, "token_pos")
            else:
                raise _err(path, n, "record lacks 'token_idx' (decode token) or 'token_pos' (raw)")
            layer = _as_int(r["layer"], path, n, "layer")
            ex = r["experts"]
            if not isinstance(ex, list) or not ex:
                raise _err(path, n, f"'experts' must be a non-empty list of ids, got {json.dumps(ex)}")
            ex = [_as_int(e, path, n, "experts") for e in ex]
            if len(set(ex)) != len(ex):
                raise _err(path, n, f"'experts' repeats an id: {ex}")
            if k is None:
                k = len(ex)
            elif len(ex) != k:
                raise _err(path, n, f"{len(ex)} experts where earlier records have {k}")
            g = r.get("gating_probs")
            if g is not None:
                if (not isinstance(g, list) or len(g) != k
                        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in g)):
                    raise _err(path, n, f"'gating_probs' must be {k} numbers, got {json.dumps(g)}")
                any_gates = True
            max_layer = max(max_layer, layer)
            max_expert = max(max_expert, max(ex))
            key = (str(r.get("dataset", "")), r.get("problem_id", 0))
            grp = groups.setdefault(key, {"fmt": fmt, "recs": [], "line": n})
            if grp["fmt"] != fmt:
                raise _err(path, n, "record mixes 'token_idx' and 'token_pos' formats within "
                                    f"{_gname(key)} (first record at line {grp['line']})")
            grp["recs"].append((n, layer, tok, ex, g))
    if k is None:
        raise _err(path, None, "no records")
    L, E = _finish_shape(path, max_layer, max_expert, k, num_layers, num_experts, top_k)
    seqs: list[RoutedSequence] = []
    for key, grp in groups.items():
        if grp["fmt"] == "idx":
            toks: dict = {}
            for n, layer, tok, ex, g in grp["recs"]:
                if (tok, layer) in toks:
                    raise _err(path, n, f"token_idx {tok} layer {layer} of {_gname(key)} given twice")
                toks[(tok, layer)] = (ex, g)
            e, gt = _dense(toks, L, k, any_gates)
            seqs.append(RoutedSequence(_gname(key), e, gt))
        else:
            seqs += _raw_sequences(path, key, grp["recs"], L, k, any_gates)
    trace = RoutingTrace(os.path.splitext(os.path.basename(path))[0], L, E, k, seqs,
                         source=os.path.abspath(path))
    fmts = sorted({g["fmt"] for g in groups.values()})
    if "idx" in fmts:
        trace.notes.append("token_idx format: producer numbered each layer's records separately "
                           "after dropping [0.5, 0.5]-gate records; after a drop that layer is "
                           "shifted by one token (not repairable)")
    if "pos" in fmts:
        trace.notes.append("token_pos (raw) format: forward passes split by layer order; "
                           "multi-row passes are prefill, single-row passes decode steps")
    miss = trace.missing_routes()
    if miss:
        trace.notes.append(f"{miss} of {trace.num_tokens * L} decode (token, layer) routes "
                           "not recorded (-1, no expert reads)")
    return trace


def _gname(key) -> str:
    ds, pid = key
    return f"{ds}/{pid}" if ds else f"problem {pid}"


def _raw_sequences(path, key, recs, L, k, with_gates):
    """Raw profiler records (file order) -> sequences: prefill passes, then decode passes."""
    passes: list[list] = []
    prev = None
    for rec in recs:
        n, layer, pos, ex, g = rec
        if prev is None or layer < prev[1] or (layer == prev[1] and pos <= prev[2]):
            passes.append([])
        passes[-1].append(rec)
        prev = rec
    seqs: list[RoutedSequence] = []
    pre: dict = {}
    pre_len = 0
    dec: dict = {}
    t = 0

    def flush():
        nonlocal pre, pre_len, dec, t
        if not dec and not pre:
            return
        name = _gname(key) + (f"#{len(seqs) + 1}" if seqs else "")
        e, gt = _dense(dec, L, k, with_gates)
        pe, pg = _dense(pre, L, k, with_gates) if pre else (None, None)
        seqs.append(RoutedSequence(name, e, gt, pe, pg))
        pre, pre_len, dec, t = {}, 0, {}, 0

    for p in passes:
        rows = {pos for _, _, pos, _, _ in p}
        if max(rows) > 0:  # a prompt pass
            if dec:  # a new prompt after decode: a new sequence
                flush()
            for n, layer, pos, ex, g in p:
                if (pre_len + pos, layer) in pre:
                    raise _err(path, n, f"token_pos {pos} layer {layer} repeated in one forward pass")
                pre[(pre_len + pos, layer)] = (ex, g)
            pre_len += max(rows) + 1
        else:
            for n, layer, pos, ex, g in p:
                dec[(t, layer)] = (ex, g)
            t += 1
    flush()
    if len(seqs) > 1:
        seqs[0].name += "#1"
    return seqs


# ---------------------------------------------------------------------------------------------
# CSV

def load_csv(path: str, *, num_layers: int | None = None, num_experts: int | None = None,
             top_k: int | None = None) -> RoutingTrace:
    """Read a `layer,token,e0,...,e{k-1}[,g0,...]` CSV file (format in the module doc)."""
    toks: dict = {}
    k = None
    ngates = 0
    header_seen = False
    max_layer = max_expert = -1
    first = True
    with _open_text(path) as f:
        for n, row in enumerate(csv.reader(f), 1):
            if not row or not "".join(row).strip() or row[0].lstrip().startswith("#"):
                continue
            cells = [c.strip() for c in row]
            if first and cells[0].lower() == "layer":
                first = False
                header_seen = True
                names = [c.lower() for c in cells]
                ecols = [c for c in names[2:] if c.startswith("e")]
                gcols = [c for c in names[2:] if c.startswith("g")]
                k = len(ecols)
                want = ["layer", "token"] + [f"e{i}" for i in range(k)] + [f"g{i}" for i in range(len(gcols))]
                if k == 0 or names != want or (gcols and len(gcols) != k):
                    raise _err(path, n, "header must be layer,token,e0,...,e{k-1} optionally "
                                        f"followed by g0,...,g{{k-1}}; got {','.join(cells)}")
                ngates = len(gcols)
                continue
            first = False
            if k is None:
                k = len(cells) - 2
                if k < 1:
                    raise _err(path, n, f"a row needs layer,token and at least one expert id, got {len(cells)} fields")
            if len(cells) != 2 + k + ngates:
                raise _err(path, n, f"{len(cells)} fields, expected {2 + k + ngates} "
                                    f"(layer,token,e0..e{k - 1}{',g0..' if ngates else ''})")
            try:
                ints = [int(c) for c in cells[:2 + k]]
            except ValueError:
                bad = next(c for c in cells[:2 + k] if not _is_int(c))
                hint = "" if header_seen else " (gate columns need a header naming them)"
                raise _err(path, n, f"'{bad}' is not an integer{hint}") from None
            if min(ints) < 0:
                raise _err(path, n, "layer, token and expert ids must be >= 0")
            try:
                g = [float(c) for c in cells[2 + k:]] if ngates else None
            except ValueError:
                raise _err(path, n, "gate weights must be numbers") from None
            layer, tok, ex = ints[0], ints[1], ints[2:]
            if len(set(ex)) != k:
                raise _err(path, n, f"expert ids repeat: {ex}")
            if (tok, layer) in toks:
                raise _err(path, n, f"layer {layer} token {tok} given twice")
            toks[(tok, layer)] = (ex, g)
            max_layer = max(max_layer, layer)
            max_expert = max(max_expert, max(ex))
    if not toks:
        raise _err(path, None, "no rows")
    L, E = _finish_shape(path, max_layer, max_expert, k, num_layers, num_experts, top_k)
    e, gt = _dense(toks, L, k, ngates > 0)
    name = os.path.splitext(os.path.basename(path))[0]
    trace = RoutingTrace(name, L, E, k, [RoutedSequence(name, e, gt)], source=os.path.abspath(path))
    miss = trace.missing_routes()
    if miss:
        trace.notes.append(f"{miss} of {trace.num_tokens * L} (token, layer) routes have no row (-1)")
    return trace


def _is_int(c: str) -> bool:
    try:
        int(c)
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# synthetic

SYNTHETIC_DEFAULTS = dict(layers=40, experts=256, k=8, steps=2000, skew=1.1, seed=0, sequences=1,
                          prefill=256, drift=1.0, tau=500.0, stick=1.0)


def synthetic_trace(layers: int = 40, experts: int = 256, k: int = 8, steps: int = 2000,
                    skew: float = 1.1, seed: int = 0, sequences: int = 1, prefill: int = 256,
                    drift: float = 1.0, tau: float = 500.0, stick: float = 1.0) -> RoutingTrace:
    """SYNTHETIC skewed routing (not from any model): see the module doc for the process."""
    if layers < 1 or experts < 1 or steps < 0 or sequences < 1 or prefill < 0:
        raise FreeTokenError("synthetic routing: layers, experts, sequences must be >= 1; "
                             "steps, prefill >= 0")
    if not 1 <= k <= experts:
        raise FreeTokenError(f"synthetic routing: k must be in [1, experts={experts}], not {k}")
    if skew < 0 or drift < 0 or tau <= 0:
        raise FreeTokenError("synthetic routing: skew, drift must be >= 0 and tau > 0")
    rng = np.random.default_rng(seed)
    L, E = layers, experts
    ranks = np.stack([rng.permutation(E) for _ in range(L)]) + 1  # rank of each expert, per layer
    base = (-skew * np.log(ranks)).astype(np.float64)
    a = math.exp(-1.0 / tau)
    b = drift * math.sqrt(1.0 - a * a)
    rows = np.arange(L)[:, None]
    seqs = []
    for s in range(sequences):
        u = rng.normal(0.0, drift, (L, E)) if drift > 0 else np.zeros((L, E))
        prev = None
        n = prefill + steps
        ex = np.empty((n, L, k), np.int32)
        gt = np.empty((n, L, k), np.float32)
        for t in range(n):
            z = base + u + rng.gumbel(size=(L, E))
            if prev is not None and stick:
                z[rows, prev] += stick
            top = np.argpartition(-z, k - 1, axis=1)[:, :k] if k < E else np.tile(np.arange(E), (L, 1))
            zt = z[rows, top]
            order = np.argsort(-zt, axis=1)
            top = top[rows, order]
            zt = zt[rows, order]
            w = np.exp(zt - zt[:, :1])
            ex[t] = top
            gt[t] = w / w.sum(1, keepdims=True)
            prev = top
            if drift > 0:
                u = a * u + b * rng.standard_normal((L, E))
        seqs.append(RoutedSequence(f"SYNTHETIC seq {s}", ex[prefill:], gt[prefill:],
                                   ex[:prefill] if prefill else None, gt[:prefill] if prefill else None))
    params = dict(layers=layers, experts=experts, k=k, steps=steps, skew=skew, seed=seed,
                  sequences=sequences, prefill=prefill, drift=drift, tau=tau, stick=stick)
    spec = "synthetic:" + ",".join(f"{key}={v}" for key, v in params.items())
    return RoutingTrace(f"SYNTHETIC L{layers} E{experts} k{k} skew{skew} seed{seed} "
                        f"{sequences}x{steps} steps", L, E, k, seqs,
                        source=spec, synthetic=True,
                        notes=["SYNTHETIC: Zipf-skewed per-layer popularity with slow drift and "
                               "temporal locality; not recorded from any model"])


def _parse_synthetic(body: str) -> tuple[dict, set]:
    params = dict(SYNTHETIC_DEFAULTS)
    given: set = set()
    if not body.strip():
        return params, given
    for item in body.split(","):
        if "=" not in item:
            raise FreeTokenError(f"synthetic routing: '{item}' is not key=value "
                                 f"(keys: {', '.join(SYNTHETIC_DEFAULTS)})")
        key, val = (x.strip() for x in item.split("=", 1))
        if key not in SYNTHETIC_DEFAULTS:
            raise FreeTokenError(f"synthetic routing: unknown key '{key}' "
                                 f"(keys: {', '.join(SYNTHETIC_DEFAULTS)})")
        typ = type(SYNTHETIC_DEFAULTS[key])
        try:
            params[key] = typ(val) if typ is float else int(val)
        except ValueError:
            raise FreeTokenError(f"synthetic routing: {key}={val} is not "
                                 f"{'a number' if typ is float else 'an integer'}") from None
        given.add(key)
    return params, given


# ---------------------------------------------------------------------------------------------
# the benchmark option

def parse_routing(spec: str, *, num_layers: int | None = None, num_experts: int | None = None,
                  top_k: int | None = None) -> RoutingTrace | None:
    """The `--routing` option: `model` -> None (use the model's own router), else a trace.

    `trace:PATH` (jsonl or CSV, by the name's extension: .jsonl/.json jsonl, .csv CSV,
    otherwise by the first character: `{` means jsonl), `jsonl:PATH`, `csv:PATH`, a bare
    existing PATH, or `synthetic[:key=value,...]` (keys in the module doc). num_layers /
    num_experts / top_k, when given (the model's shape), are checked against the trace and set
    its shape; otherwise they are inferred (largest id + 1, so unused top experts are not seen).
    """
    s = spec.strip()
    if s == "model":
        return None
    kw = dict(num_layers=num_layers, num_experts=num_experts, top_k=top_k)
    if s == "synthetic" or s.startswith("synthetic:"):
        p, explicit = _parse_synthetic(s[len("synthetic:"):] if ":" in s else "")
        for key, given in (("layers", num_layers), ("experts", num_experts), ("k", top_k)):
            if given is not None:
                if key in explicit and p[key] != given:
                    raise FreeTokenError(f"synthetic routing: {key}={p[key]} but the model has {given}")
                p[key] = given
        return synthetic_trace(**p)
    kind, _, path = s.partition(":")
    if kind in ("trace", "csv", "jsonl") and path:
        pass
    elif os.path.exists(s):
        kind, path = "trace", s
    else:
        raise FreeTokenError(f"--routing '{spec}': expected model, trace:PATH, csv:PATH, "
                             "jsonl:PATH or synthetic[:key=value,...]")
    if kind == "trace":
        ext = os.path.splitext(path)[1].lower()
        if ext in (".jsonl", ".json", ".ndjson"):
            kind = "jsonl"
        elif ext == ".csv":
            kind = "csv"
        else:
            with _open_text(path) as f:
                head = f.read(4096).lstrip()
            kind = "jsonl" if head.startswith("{") else "csv"
    return (load_jsonl if kind == "jsonl" else load_csv)(path, **kw)


def merge_traces(traces: list[RoutingTrace], name: str | None = None) -> RoutingTrace:
    """All sequences of several traces of one shape, as one trace (for batched replay)."""
    if not traces:
        raise FreeTokenError("merge_traces: no traces")
    L = max(t.num_layers for t in traces)
    E = max(t.num_experts for t in traces)
    k = traces[0].top_k
    if any(t.top_k != k for t in traces):
        raise FreeTokenError("merge_traces: traces differ in top_k")
    seqs = []
    for t in traces:
        for s in t.sequences:
            ex = s.experts
            if ex.shape[1] < L:  # fewer layers recorded: pad with 'not recorded'
                pad = np.full((ex.shape[0], L - ex.shape[1], k), -1, np.int32)
                ex = np.concatenate([ex, pad], 1)
                gt = None if s.gates is None else np.concatenate(
                    [s.gates, np.full(pad.shape, np.nan, np.float32)], 1)
                s = RoutedSequence(s.name, ex, gt, None, None)
            seqs.append(dataclasses.replace(s, name=f"{t.name}:{s.name}"))
    return RoutingTrace(name or "+".join(t.name for t in traces), L, E, k, seqs,
                        source=" ".join(t.source for t in traces),
                        synthetic=any(t.synthetic for t in traces),
                        notes=[f"{t.name}: {n}" for t in traces for n in t.notes])
