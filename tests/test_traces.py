"""Routing traces (freetoken/experts/traces.py) and the cache policy simulator (bench/policy_sim.py)."""
import itertools
import json
import random

import numpy as np
import pytest

from bench import policy_sim as ps
from freetoken.errors import FreeTokenError
from freetoken.experts.traces import (RoutedSequence, RoutingTrace, load_csv, load_jsonl,
                                      merge_traces, parse_routing, synthetic_trace)


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _rec(**kw):
    return json.dumps(kw)


# --- readers --------------------------------------------------------------------------------

def test_jsonl_token_idx_groups_orders_and_keeps_gates(tmp_path):
    f = _write(tmp_path / "t.jsonl", [
        # layer-major, as the recorded files are; problem 1 before problem 0 in the file
        _rec(dataset="gsm8k", problem_id=1, layer=0, experts=[4, 5], gating_probs=[0.6, 0.4], token_idx=0),
        _rec(dataset="gsm8k", problem_id=0, layer=0, experts=[7, 0], gating_probs=[0.8, 0.2], token_idx=0),
        _rec(dataset="gsm8k", problem_id=0, layer=0, experts=[5, 6], gating_probs=[0.7, 0.3], token_idx=1),
        _rec(dataset="gsm8k", problem_id=0, layer=1, experts=[1, 2], gating_probs=[0.9, 0.1], token_idx=0),
        "",
        _rec(dataset="gsm8k", problem_id=1, layer=1, experts=[3, 2], gating_probs=[0.5001, 0.4999], token_idx=0),
    ])
    t = load_jsonl(f)
    assert (t.num_layers, t.num_experts, t.top_k) == (2, 8, 2)
    assert [s.name for s in t.sequences] == ["gsm8k/1", "gsm8k/0"]
    s0 = t.sequences[1]
    assert s0.experts.shape == (2, 2, 2)
    assert s0.experts[0].tolist() == [[7, 0], [1, 2]]
    assert s0.experts[1].tolist() == [[5, 6], [-1, -1]]  # token 1 has no layer-1 record
    assert s0.gates[0, 0].tolist() == pytest.approx([0.8, 0.2])
    assert np.isnan(s0.gates[1, 1]).all()
    assert t.missing_routes() == 1 and t.has_gates and not t.synthetic
    # decode steps: one token per step, sequences one after the other at batch 1
    steps = list(t.decode_steps())
    assert [x.shape for x in steps] == [(2, 1, 2)] * 3
    assert steps[1][:, 0].tolist() == [[7, 0], [1, 2]]
    # the shape given by the caller is checked
    assert load_jsonl(f, num_experts=16).num_experts == 16
    with pytest.raises(FreeTokenError, match="out of range"):
        load_jsonl(f, num_experts=6)
    with pytest.raises(FreeTokenError, match="top_k=4"):
        load_jsonl(f, top_k=4)


def test_jsonl_raw_token_pos_splits_prefill_and_decode(tmp_path):
    recs = []
    for layer in range(3):  # a 3-token prompt pass: each layer's rows together
        for pos in range(3):
            recs.append(_rec(dataset="humaneval", problem_id=0, layer=layer, token_pos=pos,
                             experts=[layer, pos + 3], gating_probs=[0.7, 0.3]))
    for step in range(2):  # two decode passes; the second lacks layer 1
        for layer in range(3):
            if step == 1 and layer == 1:
                continue
            recs.append(_rec(dataset="humaneval", problem_id=0, layer=layer, token_pos=0,
                             experts=[step, 7 - layer], gating_probs=[0.6, 0.4]))
    t = load_jsonl(_write(tmp_path / "raw.jsonl", recs))
    (s,) = t.sequences
    assert s.prefill_experts.shape == (3, 3, 2)
    assert s.prefill_experts[2, 1].tolist() == [1, 5]  # token 2, layer 1
    assert s.experts.shape == (2, 3, 2)
    assert s.experts[0].tolist() == [[0, 7], [0, 6], [0, 5]]
    assert s.experts[1].tolist() == [[1, 7], [-1, -1], [1, 5]]
    assert t.missing_routes() == 1


def test_jsonl_errors_name_file_and_line(tmp_path):
    good = _rec(layer=0, token_idx=0, experts=[1, 2])
    with pytest.raises(FreeTokenError, match=r"bad\.jsonl:2: not valid JSON"):
        load_jsonl(_write(tmp_path / "bad.jsonl", [good, '{"layer": 0, "token_idx": 1, "experts": [1,']))
    with pytest.raises(FreeTokenError, match=r"k\.jsonl:2: 3 experts where earlier records have 2"):
        load_jsonl(_write(tmp_path / "k.jsonl", [good, _rec(layer=1, token_idx=0, experts=[1, 2, 3])]))
    with pytest.raises(FreeTokenError, match=r"m\.jsonl:1: record lacks 'experts'"):
        load_jsonl(_write(tmp_path / "m.jsonl", [_rec(layer=0, token_idx=0)]))
    with pytest.raises(FreeTokenError, match=r"d\.jsonl:2: token_idx 0 layer 0 .* given twice"):
        load_jsonl(_write(tmp_path / "d.jsonl", [good, good]))
    with pytest.raises(FreeTokenError, match=r"n\.jsonl:1: 'layer' must be >= 0"):
        load_jsonl(_write(tmp_path / "n.jsonl", [_rec(layer=-1, token_idx=0, experts=[1, 2])]))
    with pytest.raises(FreeTokenError, match=r"nope\.jsonl: no such file"):
        load_jsonl(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FreeTokenError) as e:
        parse_routing("trace:" + str(tmp_path / "missing.csv"))
    assert "\n" not in str(e.value)


def test_csv_with_and_without_header(tmp_path):
    rows = ["0,0,3,7", "1,0,1,4", "0,1,3,5", "1,1,0,4"]
    a = load_csv(_write(tmp_path / "a.csv", ["layer,token,e0,e1"] + rows))
    b = load_csv(_write(tmp_path / "b.csv", ["# a comment", ""] + rows[::-1]))
    for t in (a, b):
        assert (t.num_layers, t.num_experts, t.top_k, len(t.sequences)) == (2, 8, 2, 1)
        assert t.sequences[0].experts.tolist() == [[[3, 7], [1, 4]], [[3, 5], [0, 4]]]
        assert t.sequences[0].gates is None
    g = load_csv(_write(tmp_path / "g.csv", ["layer,token,e0,e1,g0,g1", "0,0,3,7,0.75,0.25"]))
    assert g.sequences[0].gates[0, 0].tolist() == [0.75, 0.25]


def test_csv_errors_name_file_and_line(tmp_path):
    with pytest.raises(FreeTokenError, match=r"x\.csv:3: 'a' is not an integer"):
        load_csv(_write(tmp_path / "x.csv", ["layer,token,e0,e1", "0,0,1,2", "1,0,a,2"]))
    with pytest.raises(FreeTokenError, match=r"y\.csv:2: 3 fields, expected 4"):
        load_csv(_write(tmp_path / "y.csv", ["0,0,1,2", "1,0,1"]))
    with pytest.raises(FreeTokenError, match=r"z\.csv:2: layer 0 token 0 given twice"):
        load_csv(_write(tmp_path / "z.csv", ["0,0,1,2", "0,0,3,4"]))
    with pytest.raises(FreeTokenError, match=r"h\.csv:1: header must be"):
        load_csv(_write(tmp_path / "h.csv", ["layer,tok,e0", "0,0,1"]))
    with pytest.raises(FreeTokenError, match=r"f\.csv:1: '0\.5' is not an integer \(gate columns need a header"):
        load_csv(_write(tmp_path / "f.csv", ["0,0,1,2,0.5,0.5"]))


def test_parse_routing_specs(tmp_path):
    assert parse_routing("model") is None
    rows = ["0,0,3,7", "1,0,1,4"]
    c = _write(tmp_path / "r.csv", rows)
    j = _write(tmp_path / "r.jsonl", [_rec(layer=0, token_idx=0, experts=[1, 2])])
    other = _write(tmp_path / "r.txt", rows)
    assert parse_routing("trace:" + c).top_k == 2
    assert parse_routing("csv:" + c).num_layers == 2
    assert parse_routing("trace:" + j).num_layers == 1
    assert parse_routing("trace:" + other).num_layers == 2  # sniffed: not JSON
    assert parse_routing(c).num_layers == 2  # a bare path
    t = parse_routing("synthetic:layers=3,experts=16,k=2,steps=5,seed=1,prefill=0")
    assert t.synthetic and t.name.startswith("SYNTHETIC") and t.sequences[0].experts.shape == (5, 3, 2)
    assert parse_routing("synthetic:steps=4,prefill=0", num_layers=2, num_experts=8,
                         top_k=2).sequences[0].experts.shape == (4, 2, 2)
    with pytest.raises(FreeTokenError, match="unknown key 'zipf'"):
        parse_routing("synthetic:zipf=2")
    with pytest.raises(FreeTokenError, match="k=8 but the model has 2"):
        parse_routing("synthetic:k=8", top_k=2)
    with pytest.raises(FreeTokenError, match="expected model, trace:PATH"):
        parse_routing("bogus")


def test_synthetic_shape_and_determinism():
    kw = dict(layers=4, experts=32, k=4, steps=50, skew=1.1, seed=3, sequences=2, prefill=10)
    a, b = synthetic_trace(**kw), synthetic_trace(**kw)
    c = synthetic_trace(**{**kw, "seed": 4})
    assert a.synthetic and "SYNTHETIC" in a.name and any("SYNTHETIC" in n for n in a.notes)
    assert (a.num_layers, a.num_experts, a.top_k, len(a.sequences)) == (4, 32, 4, 2)
    for s, s2 in zip(a.sequences, b.sequences):
        assert s.experts.shape == (50, 4, 4) and s.prefill_experts.shape == (10, 4, 4)
        assert np.array_equal(s.experts, s2.experts) and np.array_equal(s.gates, s2.gates)
        assert s.experts.min() >= 0 and s.experts.max() < 32
        assert all(len(set(row)) == 4 for row in s.experts.reshape(-1, 4).tolist())
        assert np.allclose(s.gates.sum(-1), 1.0, atol=1e-5)
    assert not np.array_equal(a.sequences[0].experts, c.sequences[0].experts)
    # skewed: the most used expert of a layer is read far more than the least used
    cnt = np.bincount(a.sequences[0].experts[:, 0].ravel(), minlength=32)
    assert cnt.max() >= 5 * max(1, np.sort(cnt)[8])


def test_decode_steps_batch_interleaves():
    def seq(n, v):
        return RoutedSequence(f"s{v}", np.full((n, 1, 1), v, np.int32))
    t = RoutingTrace("t", 1, 8, 1, [seq(3, 1), seq(1, 2), seq(2, 3)])
    steps = [x[0, :, 0].tolist() for x in t.decode_steps(batch=2)]
    assert steps == [[1, 2], [1, 3], [1, 3]]  # sequence 3 takes sequence 2's row when it ends
    assert t.step_admissions(batch=2) == [[0, 1], [2], []]
    m = merge_traces([t, t])
    assert len(m.sequences) == 6 and m.num_tokens == 12


# --- simulator ------------------------------------------------------------------------------

def _reads(groups, E, L=1, prefill=None):
    """Groups of (layer, [experts]) in order; one decode step per pass over the layers."""
    steps = [groups[i:i + L] for i in range(0, len(groups), L)]
    k = max(len(e) for _, e in groups)
    ex = np.full((len(steps), L, k), -1, np.int32)
    for t, st in enumerate(steps):
        for layer, e in st:
            ex[t, layer, :len(e)] = e
    seq = RoutedSequence("hand", ex, None, prefill)
    return ps.Reads(RoutingTrace("hand", L, E, k, [seq]), 1)


def test_lru_and_min_by_hand():
    # a b c a b c, capacity 2: LRU misses all 6; MIN: a, b, c (evicts b: a comes back first),
    # a hit, b (evicts a: never again), c hit -> 4. Warm start subtracts the 2 cold fills.
    R = _reads([(0, [x]) for x in [0, 1, 2, 0, 1, 2]], E=4)
    assert ps.sim_lru(R, 2) == 6 and ps.sim_min(R, 2) == 4
    assert ps.run_policies(R, 2, ["lru", "min"]) == {"lru": 4, "min": 2}
    # a layer's reads are classified first: the hit (0) is refreshed before the miss (2)
    # evicts, so the victim is 1, not 0 (which a read-by-read LRU would pick)
    R = _reads([(0, [0, 1]), (0, [2, 0]), (0, [0, 1])], E=4)
    assert ps.sim_lru(R, 2) == 4
    # MIN on the same: step 2 evicts 1 (0 is read now), step 3 must evict 2 for 1: 4 misses
    assert ps.sim_min(R, 2) == 4


def _brute_force_min(R, C):
    """The optimum over every demand-fill eviction choice, by exhaustive search."""
    states = {frozenset(): 0}
    for g in range(R.num_groups):
        grp = R.ids[R.starts[g]:R.starts[g + 1]]
        nxt = {}
        for st, cost in states.items():
            miss = [x for x in grp if x not in st]
            evictable = [y for y in st if y not in grp]
            need = max(0, len(st) + len(miss) - C)
            for victims in itertools.combinations(sorted(evictable), need):
                ns = frozenset((st - set(victims)) | set(miss))
                if nxt.get(ns, 1 << 30) > cost + len(miss):
                    nxt[ns] = cost + len(miss)
        states = nxt
    return min(states.values())


def _brute_force_bypass(R, C):
    """The optimum when a miss may also stay out of the cache (and any preload is free)."""
    states = {frozenset(c): 0 for c in itertools.combinations(range(R.universe), C)}
    for g in range(R.num_groups):
        grp = R.ids[R.starts[g]:R.starts[g + 1]]
        nxt = {}
        for st, cost in states.items():
            miss = [x for x in grp if x not in st]
            evictable = sorted(y for y in st if y not in grp)
            for n_in in range(len(miss) + 1):  # admit any n_in of the misses
                for admit in itertools.combinations(miss, n_in):
                    for victims in itertools.combinations(evictable, max(0, len(st) + n_in - C)):
                        ns = frozenset((st - set(victims)) | set(admit))
                        if nxt.get(ns, 1 << 30) > cost + len(miss):
                            nxt[ns] = cost + len(miss)
        states = nxt
    return min(states.values())


def _random_reads(seed, L=2, E=4, k=2, steps=12, skew=True):
    rng = random.Random(seed)
    groups = []
    for _ in range(steps):
        for layer in range(L):
            w = [1.0 / (i + 1) ** (1.5 if skew else 0) for i in range(E)]
            pick = []
            while len(pick) < k:
                x = rng.choices(range(E), w)[0]
                if x not in pick:
                    pick.append(x)
            groups.append((layer, pick))
    return _reads(groups, E=E, L=L)


@pytest.mark.parametrize("seed", range(12))
def test_min_is_the_optimum(seed):
    R = _random_reads(seed, L=2, E=3, k=2, steps=8, skew=seed % 2 == 0)
    for C in (2, 3, 4):
        assert ps.sim_min(R, C) == _brute_force_min(R, C)
        # with bypass: from a free preload, so compare the warm-start count
        warm = ps.run_policies(R, C, ["min_bypass"])["min_bypass"]
        assert warm == _brute_force_bypass(R, C)


@pytest.mark.parametrize("seed", range(8))
def test_min_never_worse_than_any_policy(seed):
    R = _random_reads(seed, L=3, E=5, k=2, steps=40, skew=seed % 2 == 0)
    for C in (2, 4, 7, 10):
        m = ps.run_policies(R, C, ps.POLICIES, half_life=4.0, has_gates=False)
        for p, v in m.items():
            assert 0 <= v <= len(R.ids)
            assert m["min_bypass"] <= v, (p, C, m)  # the optimum of all policies
            if p not in ps.STATIC | {"min_bypass"}:  # these leave misses out of the cache
                assert m["min"] <= v, (p, C, m)


def test_freq_oracle_is_the_best_static_set():
    R = _random_reads(1, L=2, E=4, k=2, steps=15)
    for C in (2, 3, 5):
        best = min(ps.sim_static(R, set(s)) for s in itertools.combinations(range(R.universe), C))
        assert ps.sim_static(R, ps.freq_oracle_set(R, C)) == best


def test_static_layers_and_hot_set():
    R = _random_reads(2, L=3, E=4, k=2, steps=5)
    assert ps.static_layers(R, 9, last=False) == set(range(8))  # 2 whole layers of 4
    assert ps.static_layers(R, 9, last=True) == set(range(4, 12))
    # hot_set takes the recorded prefill when there is one: here it names experts 0 and 1 of
    # layer 0, and the decode reads 0, 1, 2, 3 once each -> 2 misses at capacity 2
    pre = np.array([[[0, 1]], [[0, 1]], [[1, 2]]], np.int32)
    R = _reads([(0, [0, 1]), (0, [2, 3])], E=4, prefill=pre)
    assert R.prefix_source == ["prefill"]
    assert ps.sim_hot_set(R, 2) == 2
    assert ps.sim_hot_set(R, 1) == 3  # {1} only


def test_policy_sim_writes_json(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    ps.main(["synthetic:layers=4,experts=16,k=2,steps=30,seed=0,sequences=2,prefill=8",
             "--capacities", "0.25,0.5", "--batches", "1,2,4"])
    doc = json.loads((tmp_path / "policy_sim-cpu.json").read_text())
    (entry,) = doc["results"]["traces"].values()
    assert entry["synthetic"] and entry["runs"]["batch_4"]["skipped"]
    cap = entry["runs"]["batch_2"]["capacities"]["0.25"]
    assert cap["slots"] == 16 and set(cap["miss_rate"]) == set(ps.POLICIES)
    rates = cap["miss_rate"]
    assert rates["min_bypass"] == min(rates.values()) and rates["min"] <= min(
        v for p, v in rates.items() if p != "min_bypass")
