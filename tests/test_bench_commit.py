"""bench/commit.py: the commit label results record is computed from git, or from the stamp
bench/stamp_commit.sh writes where git does not work; never typed."""
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench/
from bench.commit import commit_info, stamp  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(root, *args):
    return subprocess.check_output(["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t",
                                    *args], text=True).strip()


@pytest.fixture
def repo(tmp_path):
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "benchmarks" / "results").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x = 1\n")
    (root / ".gitignore").write_text("/.devcache/\n*.log\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "one")
    return root


def test_clean_dirty_and_what_counts(repo):
    head = git(repo, "rev-parse", "--short", "HEAD")
    assert commit_info(str(repo)) == {"commit": head, "changed": [], "source": "git"}
    (repo / "benchmarks" / "results" / "x-cpu.json").write_text("{}")  # results are not code
    (repo / "run.log").write_text("ignored")
    assert commit_info(str(repo))["commit"] == head
    (repo / "pkg" / "new.py").write_text("")  # untracked, not ignored: counts
    info = commit_info(str(repo))
    assert info["commit"] == head + "-dirty" and info["changed"] == ["pkg/new.py"]
    (repo / "pkg" / "new.py").unlink()
    (repo / "pkg" / "a.py").write_text("x = 2\n")  # modified
    assert commit_info(str(repo))["commit"] == head + "-dirty"


def test_without_git_the_stamp_then_unknown(repo, tmp_path):
    head = git(repo, "rev-parse", "--short", "HEAD")
    (repo / "pkg" / "a.py").write_text("x = 3\n")
    doc = stamp(str(repo), str(repo / ".devcache" / "commit"))
    assert doc["commit"] == head + "-dirty" and doc["changed"] == ["pkg/a.py"]
    # the device machine's copy: the tree and .devcache, no .git
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    st = str(copy / ".devcache" / "commit")
    assert commit_info(str(copy), st) == {"commit": head + "-dirty", "source": "stamp", "changed": ["pkg/a.py"]}
    (copy / "benchmarks" / "results" / "y-gpu.json").write_text("{}")  # results written there: still matches
    assert commit_info(str(copy), st)["commit"] == head + "-dirty"
    (copy / "pkg" / "a.py").write_text("x = 4\n")  # edited after the stamp
    assert commit_info(str(copy), st)["commit"] == head + "-dirty-stale"
    os.remove(st)
    assert commit_info(str(copy), st) == {"commit": "unknown", "source": "none"}


def test_a_tree_inside_another_repository_is_not_read_from_it(repo):
    inner = repo / "pkg" / "inner"
    inner.mkdir()
    assert commit_info(str(inner), str(inner / "nostamp"))["commit"] == "unknown"


def test_on_the_device_a_stale_git_does_not_name_the_results(repo, tmp_path, monkeypatch):
    """The GPU machine may keep a .git from an earlier call, at another commit: with
    FT_COMMIT_SOURCE=stamp (bench/device_env.sh) a tree that moved since its stamp is labelled
    from the stamp, -stale, not from that .git (plan 146's files said 9a9608c-dirty)."""
    old = git(repo, "rev-parse", "--short", "HEAD")
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy)  # the machine's copy from an earlier call, .git and all
    (repo / "pkg" / "a.py").write_text("x = 5\n")
    git(repo, "commit", "-qam", "two")
    new = git(repo, "rev-parse", "--short", "HEAD")
    stamp(str(repo), str(repo / ".devcache" / "commit"))
    shutil.copytree(repo / ".devcache", copy / ".devcache")
    (copy / "pkg" / "a.py").write_text("x = 6\n")  # this call's tree, edited after the stamp
    st = str(copy / ".devcache" / "commit")
    assert commit_info(str(copy), st)["commit"] == old + "-dirty"  # what git says there: the wrong commit
    monkeypatch.setenv("FT_COMMIT_SOURCE", "stamp")
    assert commit_info(str(copy), st)["commit"] == new + "-stale"
    shutil.copy(repo / "pkg" / "a.py", copy / "pkg" / "a.py")  # the stamped tree itself
    assert commit_info(str(copy), st) == {"commit": new, "source": "stamp", "changed": []}
