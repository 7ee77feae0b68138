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


def test_openmp_spin_set_before_torch_and_dropped_for_children(monkeypatch):
    """freetoken/omp_env.py: GOMP_SPINCOUNT / KMP_BLOCKTIME set only where the user has not and
    torch is not loaded yet (its OpenMP reads them at load); the programs we start get the user's."""
    import subprocess
    import sys

    from freetoken import omp_env
    code = ("import os, freetoken, torch; from freetoken.cuda_queues import child_env; "
            "print(os.environ.get('GOMP_SPINCOUNT'), child_env().get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in omp_env.DEFAULTS and k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [omp_env.DEFAULTS["GOMP_SPINCOUNT"], "None"]  # set here, not passed on
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, GOMP_SPINCOUNT="300000"), capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["300000", "300000"]  # the user's value wins and is passed on
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, OMP_WAIT_POLICY="passive"), capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["None", "None"]  # the user's wait policy decides the spin: left alone
    late = "import os, torch, freetoken; print(os.environ.get('GOMP_SPINCOUNT'))"  # torch first: too late
    assert subprocess.run([sys.executable, "-c", late], env=env, capture_output=True, text=True,
                          check=True).stdout.split() == ["None"]
    monkeypatch.setattr(omp_env, "set_here", {"GOMP_SPINCOUNT": "10000"})
    assert omp_env.strip({"GOMP_SPINCOUNT": "10000", "A": "1"}) == {"A": "1"}
    assert omp_env.strip({"GOMP_SPINCOUNT": "5"}) == {"GOMP_SPINCOUNT": "5"}  # the user's own: kept
