"""freetoken/cuda_queues.py: the launch queues' scale set for this process only where the user
has not set it (and not on a Jetson), and dropped again from the programs we start."""
import os

from freetoken import cuda_queues as cq


def test_set_when_unset_and_dropped_for_children(monkeypatch):
    monkeypatch.delenv(cq.VAR, raising=False)
    monkeypatch.setattr(cq, "set_here", False)
    monkeypatch.setattr(cq, "tegra", lambda: False)
    assert cq.apply() and cq.set_here
    assert os.environ[cq.VAR] == cq.SCALE
    assert cq.VAR not in cq.child_env()  # a llama.cpp baseline or a client: the driver's default
    assert cq.VAR not in cq.child_env({cq.VAR: cq.SCALE, "A": "1"}) and cq.child_env({"A": "1"}) == {"A": "1"}


def test_the_users_setting_wins_and_is_passed_on(monkeypatch):
    monkeypatch.setenv(cq.VAR, "2x")
    monkeypatch.setattr(cq, "set_here", False)
    assert not cq.apply()
    assert os.environ[cq.VAR] == "2x" and cq.child_env()[cq.VAR] == "2x"
    monkeypatch.setenv(cq.VAR, cq.SCALE)  # the user's own 4x is theirs too
    assert cq.child_env()[cq.VAR] == cq.SCALE


def test_not_on_a_jetson(monkeypatch):
    monkeypatch.delenv(cq.VAR, raising=False)
    monkeypatch.setattr(cq, "set_here", False)
    monkeypatch.setattr(cq, "tegra", lambda: True)
    assert not cq.apply() and cq.VAR not in os.environ
