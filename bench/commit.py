"""The commit label every result records: computed from git, never typed.

    label = `git rev-parse --short HEAD`, plus "-dirty" when the working tree differs from HEAD:
            a modified, staged, deleted or untracked-but-not-ignored file (untracked files count:
            a new module is code that runs, and the device tool carries them too). Files under
            benchmarks/results/ do not count: the benchmarks write them, they are not code.

Where git does not work (the GPU machine gets a copy of the tree without a usable .git), the
label comes from .devcache/commit, which `bench/stamp_commit.sh` (`python3 -m bench.commit
--stamp`) writes here before a device call; the device tool carries .devcache/ along. The stamp
also holds a fingerprint of the tree it was made for: a tree that no longer matches it (stamped,
then edited) gets the label "<label>-stale". With neither git nor a stamp: "unknown".
No torch import here, so stamping is quick.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = os.path.join(ROOT, ".devcache", "commit")
NOT_CODE = "benchmarks/results"  # written by the benchmarks themselves


def _git(root: str, *args: str) -> str:
    # --no-optional-locks: `status` must not take the index lock of a tree others work in
    return subprocess.check_output(["git", "--no-optional-locks", "-C", root, *args], text=True,
                                   stderr=subprocess.DEVNULL)


def from_git(root: str = ROOT) -> dict | None:
    """{"commit", "changed"} from git, or None where git does not work on `root` itself (no git,
    no .git, or `root` is only inside some other repository)."""
    try:
        top = _git(root, "rev-parse", "--show-toplevel").strip()
        if os.path.realpath(top) != os.path.realpath(root):
            return None
        rev = _git(root, "rev-parse", "--short", "HEAD").strip()
        status = _git(root, "status", "--porcelain", "--untracked-files=all", "--", ".",
                      f":(exclude){NOT_CODE}")
    except (OSError, subprocess.CalledProcessError):
        return None
    changed = sorted(ln[3:] for ln in status.splitlines() if ln.strip())
    return {"commit": rev + ("-dirty" if changed else ""), "changed": changed}


def tree_files(root: str = ROOT) -> list[str]:
    """The files that make up the tree (tracked and untracked-not-ignored, what the device tool
    copies), benchmarks/results/ excepted."""
    out = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return sorted({p for p in out.split("\0") if p and not p.startswith(NOT_CODE + "/")
                   and os.path.isfile(os.path.join(root, p))})


def fingerprint(files: list[str], root: str = ROOT) -> str | None:
    """sha256 over the paths and contents; None when one of them is missing."""
    h = hashlib.sha256()
    for p in files:
        try:
            with open(os.path.join(root, p), "rb") as f:
                data = f.read()
        except OSError:
            return None
        h.update(p.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def stamp(root: str = ROOT, path: str = STAMP) -> dict:
    """Write the git-computed label and the tree's fingerprint to `path` (.devcache/commit)."""
    g = from_git(root)
    if g is None:
        raise SystemExit(f"stamp: git does not work in {root}")
    files = tree_files(root)
    doc = dict(g, files=files, tree=fingerprint(files, root))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=0)
    os.replace(path + ".tmp", path)
    return doc


def commit_info(root: str = ROOT, path: str = STAMP) -> dict:
    """{"commit", "source": "git" | "stamp" | "none", "changed"?}: the stamp when it matches the
    tree here, else git when it works on `root`, else the stamp marked stale, else "unknown"."""
    try:
        with open(path) as f:
            doc = json.load(f)
        label, files, tree = doc["commit"], doc["files"], doc["tree"]
    except (OSError, ValueError, KeyError, TypeError):
        doc = None
    # a stamp that matches this tree wins: the GPU machine's copy may carry a stale .git of an
    # earlier call, whose HEAD is not the commit the tree came from
    if doc is not None and fingerprint(files, root) == tree:
        return {"commit": label, "source": "stamp", "changed": doc.get("changed", [])}
    # FT_COMMIT_SOURCE=stamp (bench/device_env.sh, the GPU machine): never that stale .git
    g = None if os.environ.get("FT_COMMIT_SOURCE") == "stamp" and doc is not None else from_git(root)
    if g is not None:
        return dict(g, source="git")
    if doc is None:
        return {"commit": "unknown", "source": "none"}
    info = {"commit": label, "source": "stamp", "changed": doc.get("changed", [])}
    if fingerprint(files, root) != tree:
        print(f"warning: {path} was stamped for another tree (run bench/stamp_commit.sh before the call); "
              f"the label says {label}-stale", file=sys.stderr)
        info["commit"] = label + "-stale"
    return info


def commit() -> str:
    return commit_info()["commit"]


if __name__ == "__main__":
    if sys.argv[1:] == ["--stamp"]:
        d = stamp()
        print(f"{d['commit']} ({len(d['files'])} files) -> {os.path.relpath(STAMP)}")
    elif not sys.argv[1:]:
        print(commit())
    else:
        raise SystemExit("usage: python3 -m bench.commit [--stamp]")
