"""bench/graph_race.py: its GEMM chain is the product it stands for, and on a machine without
CUDA it says so and measures nothing (no result file)."""
import sys

import pytest
import torch

from bench import graph_race


def test_chain_is_the_product():
    g = torch.Generator().manual_seed(3)
    ws = [(torch.randn(24, 96, generator=g) / 5, torch.randn(96, 24, generator=g) / 10) for _ in range(2)]
    x = torch.randn(2, 24, generator=g)
    want = x @ ws[0][0] @ ws[0][1] @ ws[1][0] @ ws[1][1]
    assert torch.allclose(graph_race.chain(x, ws), want, atol=1e-5)


def test_the_check_counts_mismatches_and_nans():
    """Checked (what each graph ends with): its own result passes; a changed weight, and a NaN,
    count as mismatches, and the largest difference is kept (a NaN as inf)."""
    g = torch.Generator().manual_seed(4)
    ws = [(torch.randn(16, 64, generator=g) / 4, torch.randn(64, 16, generator=g) / 8)]
    c = graph_race.Checked(torch.randn(3, 16, generator=g), ws, tol=0.02)
    c()
    assert int(c.bad) == 0 and float(c.worst) == 0.0
    ws[0][1].mul_(1.5)  # a wrong result
    c()
    assert int(c.bad) == 1 and float(c.worst) > 0
    ws[0][0][0, 0] = float("nan")
    c()
    assert int(c.bad) == 2 and float(c.worst) == float("inf")
    c.reset()
    assert int(c.bad) == 0 and float(c.worst) == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_without_cuda_it_measures_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["graph_race"])
    graph_race.main()
    assert "needs CUDA" in capsys.readouterr().out and not list(tmp_path.iterdir())
