"""Radix tree, checkpoint LRU and anchor detection: plain Python, no torch."""
import subprocess
import sys

import pytest

from freetoken.cache.anchors import CheckpointPolicy, CheckpointStore, anchor_ids, turn_open_ids
from freetoken.cache.radix import RadixCache


def test_no_torch_import():
    code = "import sys, freetoken.cache.radix, freetoken.cache.anchors; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_match_insert_split_and_dedup():
    rc = RadixCache(page_size=2)
    a = [1, 2, 3, 4, 5, 6, 7]
    node, dup = rc.insert(a, [10, 11, 12])  # 3 whole pages; token 7 is a partial page
    assert dup == [] and rc.cached_pages == 3
    assert rc.match(a) == (6, [10, 11, 12], node)
    b = [1, 2, 3, 4, 9, 9, 8, 8]
    n, pages, _ = rc.match(b)
    assert (n, pages) == (4, [10, 11])  # diverges inside the first edge: split at a page boundary
    node_b, dup = rc.insert(b, [20, 21, 22, 23])
    assert dup == [20, 21] and rc.cached_pages == 5  # the shared two pages are kept once
    assert rc.match(b)[:2] == (8, [10, 11, 22, 23])
    assert rc.match([1, 2, 3])[:2] == (2, [10])  # page-aligned matches only
    assert rc.match([7, 7])[:2] == (0, [])
    # partial: the first tokens of the next page count too, with that page
    assert rc.match([1, 2, 3, 4, 9, 7], partial=True)[:2] == (5, [10, 11, 22])
    assert rc.match([1, 2, 3], partial=True)[:2] == (3, [10, 11])


def test_partial_tail_pages():
    rc = RadixCache(page_size=4)
    rc.insert([1, 2, 3, 4, 5, 6], [10, 11])  # one full page and a partial one
    assert rc.match([1, 2, 3, 4, 5, 6, 7], partial=True)[:2] == (6, [10, 11])
    assert rc.match([1, 2, 3, 4, 5, 9], partial=True)[:2] == (5, [10, 11])
    # a later, longer sequence extends the path; the partial leaf stays until evicted
    node, dup = rc.insert([1, 2, 3, 4, 5, 6, 7, 8, 9], [20, 21, 22])
    assert dup == [20]
    assert rc.match([1, 2, 3, 4, 5, 6, 7, 8, 9, 9], partial=True)[:2] == (9, [10, 21, 22])
    # inserting a tail already inside a cached page returns its page as a duplicate
    _, dup = rc.insert([1, 2, 3, 4, 5], [30, 31])
    assert dup == [30, 31]


def test_lru_eviction_spares_locked_prefixes():
    rc = RadixCache(page_size=1)
    n1, _ = rc.insert([1, 2, 3], [1, 2, 3])
    n2, _ = rc.insert([1, 2, 9], [4, 5, 6])
    n3, _ = rc.insert([7, 8], [7, 8])
    rc.lock(n2)
    rc.match([7, 8])  # touch: n1's leaf is now the least recently used
    assert rc.evict(1) == [3]
    freed = rc.evict(10)
    assert sorted(freed) == [7, 8]  # [1, 2] and [9] are held by the lock
    rc.unlock(n2)
    assert sorted(rc.evict(10)) == [1, 2, 6]
    assert rc.cached_pages == 0


@pytest.mark.parametrize("policy,expected", [
    ("anchors", [2, 3, 5, 6, 9, 10]),
    ("interval:4", [4, 8]),
    ("none", []),
])
def test_checkpoint_positions(policy, expected):
    # 100 = <|im_start|>, 101 = <|im_end|> in this fake vocabulary
    toks = [0, 0, 100, 7, 7, 101, 7, 7, 7, 100]
    pol = CheckpointPolicy(policy, {100, 101}, min_gap=0)
    assert pol.positions(toks, 0, len(toks)) == expected
    assert pol.positions(toks, 3, 6) == [p for p in expected if 3 < p <= 6]
    # the boundary before an anchor that is the next, not yet processed token
    if policy == "anchors":
        assert pol.positions(toks, 0, 2) == [2]


def test_anchor_clusters_are_thinned_but_turn_starts_kept():
    # 100 = <|im_start|> (turn opener), 101 = <|im_end|>, 102 = </tool_call>
    toks = [5] * 10 + [102, 101, 9, 100, 4, 4] + [5] * 10 + [101]
    pol = CheckpointPolicy("anchors", {100, 101, 102}, turn_open={100}, min_gap=4)
    # 10: before </tool_call> (nothing in the 4 before it); 11, 12: crowded; 13: before
    # <|im_start|>, always; 14: right after it, crowded; 26: before the last <|im_end|>;
    # 27: right after it, crowded
    assert pol.positions(toks, 0, len(toks)) == [10, 13, 26]


def test_anchor_ids_come_from_the_tokenizer():
    vocab = {"<|im_start|>": 5, "<|im_end|>": 6, "<think>": 9}
    assert anchor_ids(vocab.get) == {5, 6, 9}


def test_harmony_anchors():
    """GPT-OSS's Harmony messages: <|start|>role<|channel|>c<|message|>text<|end|> (or <|call|>,
    <|return|>): checkpoints before each turn opener and around the message ends."""
    vocab = {"<|start|>": 1, "<|message|>": 2, "<|end|>": 3, "<|call|>": 4, "<|return|>": 5, "<|channel|>": 6}
    assert anchor_ids(vocab.get) == {1, 2, 3, 4, 5} and turn_open_ids(vocab.get) == {1}
    pol = CheckpointPolicy("anchors", anchor_ids(vocab.get), turn_open_ids(vocab.get), min_gap=8)
    system = [1, 40, 2] + [50] * 20 + [3]  # system message, 24 tokens
    user = [1, 41, 2] + [51] * 12 + [3]  # user message, 16 tokens
    head = [1, 42, 6, 43, 2]  # the assistant's header, its answer follows
    toks = system + user + head
    # 3 (after the first <|message|>): crowded by the <|start|> 3 tokens back; 23: before <|end|>;
    # 24: before <|start|>, always; 25..27 crowded; 39 (before <|end|>) and 40 (before <|start|>)
    # kept, then crowded up to the end
    assert pol.positions(toks, 0, len(toks)) == [23, 24, 39, 40]
    # DeepSeek-V4's turns: <｜User｜> opens one, an answer ends in <｜end▁of▁sentence｜>
    ds = {"<｜User｜>": 7, "<｜Assistant｜>": 8, "<｜end▁of▁sentence｜>": 9, "</think>": 10}
    assert anchor_ids(ds.get) == {7, 8, 9, 10} and turn_open_ids(ds.get) == {7}


def test_bad_policy():
    for bad in ("interval:x", "interval:0", "always"):
        with pytest.raises(ValueError):
            CheckpointPolicy(bad, set())


def test_checkpoint_store_lru():
    st = CheckpointStore(2)
    s1 = st.reserve([1, 2])
    s2 = st.reserve([1, 2, 3, 4])
    assert st.lookup([1, 2, 3, 4, 5], 5) == (4, s2)
    assert st.lookup([1, 2, 3, 4, 5], 3) == (2, s1)  # deepest one at or before the limit
    s3 = st.reserve([9])  # full: evicts the LRU entry, [1, 2, 3, 4] (looked up before [1, 2])
    assert s3 == s2 and st.evictions == 1
    assert st.lookup([1, 2, 3, 4], 4) == (2, s1)
    assert st.lookup([5], 1) == (0, None)
    assert CheckpointStore(0).reserve([1]) is None
