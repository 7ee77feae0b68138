"""bench/graph_race.py: its GEMM chain is the product it stands for, and on a machine without
CUDA it says so and measures nothing (no result file)."""
import sys

import pytest
import torch

from bench import graph_race


def test_chain_is_the_product():
    g = torch.Generator().manual_seed(3)
    ws = [torch.randn(24, 24, generator=g) / 5 for _ in range(3)]
    x = torch.randn(2, 24, generator=g)
    assert torch.allclose(graph_race.chain(x, ws), x @ ws[0] @ ws[1] @ ws[2], atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's answer")
def test_without_cuda_it_measures_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["graph_race"])
    graph_race.main()
    assert "needs CUDA" in capsys.readouterr().out and not list(tmp_path.iterdir())
