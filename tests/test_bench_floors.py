"""bench.expert_cache's analytic floors (the figures its rows are judged against)."""
import pytest

from bench.expert_cache import floors

MB = 6.29e6  # one full-size Qwen3.6 expert, bf16


def row(mode, fills, cpu, ms, batch=1):
    return {"mode": mode, "fills_per_step": fills, "cpu_experts_per_step": cpu, "ms_per_step": ms, "batch": batch}


def test_fill_only_counts_the_link_alone():
    f = floors(row("fill-only", 62, 0, 9.6), 1.55, bp=48.5, bh=57.1, dram=98.0, expert_bytes=MB)
    assert f["floor_ms"] == pytest.approx(1.55 + 62 * MB / 48.5e9 * 1e3, abs=1e-3)
    assert f["dram_floor_ms"] == f["floor_ms"]  # the link alone is under the DRAM rate: no cap
    assert f["floor_tok_s"] == pytest.approx(1e3 / f["floor_ms"], abs=0.1)


def test_split_adds_both_bandwidths_and_the_dram_caps_them():
    # the H200 6-thread row: 30.75 fills + 30.77 CPU experts a step at r = 0.5, 6.22 ms measured
    f = floors(row("split", 30.75, 30.77, 6.22), 1.554, bp=48.5, bh=57.1, dram=98.0, expert_bytes=MB)
    assert f["floor_ms"] == pytest.approx(5.22, abs=0.01)  # what the file records (floor_ms 5.219)
    assert f["dram_floor_ms"] == pytest.approx(1.554 + 61.52 * MB / 98e9 * 1e3, abs=1e-3)
    assert f["floor_ms"] < f["dram_floor_ms"] < 6.22
    assert f["of_dram_floor"] == pytest.approx(f["dram_floor_ms"] / 6.22, abs=1e-3)


def test_no_dram_figure_no_dram_floor():
    f = floors(row("cache", 10, 10, 5.0, batch=4), 2.0, bp=50.0, bh=40.0, dram=None, expert_bytes=MB)
    assert "dram_floor_ms" not in f and f["floor_tok_s"] == pytest.approx(4e3 / f["floor_ms"], abs=0.1)
