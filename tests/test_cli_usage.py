"""The command line as a new user meets it: help, --version, -v anywhere, defaults in every
help, --prompt-file, model folders with several files, convert into a new folder."""
import argparse
import io
import json
import os
import shutil
import sys

import pytest

import hf_models
from test_bad_input import assert_one_line_error, ft
from freetoken.cli import main
from freetoken.weights.convert import convert


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    hf_models.save(hf_models.qwen3_moe(2, max_position_embeddings=64), str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return d


def test_bare_ft_prints_help():
    code, out, err = ft()
    assert code == 2
    assert "usage: ft" in err and "generate" in err and "serve" in err and "convert" in err
    assert "required" not in err


def test_version():
    import freetoken
    code, out, _ = ft("--version")
    assert code == 0 and out.strip() == f"ft {freetoken.__version__} (distribution {freetoken.__distribution__})"


def subparsers(parser):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a.choices
    raise AssertionError("no subcommands")


def test_every_option_has_help_and_shows_its_default():
    from freetoken.cli import build_parser
    parser = build_parser()
    for name, sp in subparsers(parser).items():
        text = " ".join(sp.format_help().split())  # unwrapped
        for a in sp._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS:
                continue
            assert a.help, (name, a.option_strings)
            if any(a.default is v for v in (None, False, argparse.SUPPRESS)) or a.dest == "help":
                continue
            assert f"(default: {a.default})" in text, (name, a.option_strings, a.default)
    helps = {n: sp.format_help() for n, sp in subparsers(parser).items()}
    assert "(default: 8000)" in helps["serve"] and "(default: 127.0.0.1)" in helps["serve"]
    assert "--prompt-file" in helps["generate"] and "(default: 64)" in helps["generate"]


def test_verbose_before_or_after_the_command(tiny):
    """-v anywhere sets what main() logs by (its parse is main()'s own); a process with -v last
    logs at INFO, one without it does not."""
    from freetoken.cli import build_parser
    m = str(tiny / "m.ftw")
    for args in (["-v", "generate", m], ["generate", "-v", m], ["generate", m, "-v"]):
        assert build_parser().parse_args([*args, "--prompt-ids", "1,2"]).verbose is True, args
    assert build_parser().parse_args(["generate", m, "--prompt-ids", "1,2"]).verbose is False
    code, _, err = ft("generate", m, "--prompt-ids", "1,2", "--max-tokens", "1", "-v")
    assert code == 0, err
    assert "INFO freetoken.weights: loading m.ftw" in err, err
    code, _, err = ft("generate", m, "--prompt-ids", "1,2", "--max-tokens", "1")
    assert code == 0 and "INFO" not in err


def ft_here(capsys, *args):
    """(exit status, stdout, stderr) of `ft ARGS` through main() in this process: what the
    tests below check of a run is main()'s doing, and each `ft` process costs seconds of
    imports (the tests above run real processes)."""
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def gen_json(capsys, *args):
    """`ft generate ARGS --json` in this process (the three runs compared below share it, so
    the same threads and kernels)."""
    code, out, err = ft_here(capsys, "generate", *args, "--json", "--max-tokens", "3", "--ignore-eos")
    assert code == 0, err
    return json.loads(out)


def test_prompt_file_and_stdin(tiny, tmp_path, capsys, monkeypatch):
    m = str(tiny / "m.ftw")
    text = "the theorem\nin there \u00e9t\u00e9 "  # exact bytes, trailing space and newline kept
    fn = tmp_path / "p.txt"
    fn.write_text(text, encoding="utf-8")
    ref = gen_json(capsys, m, "--prompt", text)
    assert ref["prompt_tokens"] > 5
    from_file = gen_json(capsys, m, "--prompt-file", str(fn))
    # standard input as a process has it: bytes under sys.stdin.buffer
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text.encode("utf-8")), encoding="utf-8"))
    from_stdin = gen_json(capsys, m, "--prompt-file", "-")
    for got in (from_file, from_stdin):
        assert (got["prompt_tokens"], got["token_ids"], got["text"]) == \
            (ref["prompt_tokens"], ref["token_ids"], ref["text"])


def test_prompt_file_beyond_the_command_line_limit(tiny, tmp_path, capsys):
    """Over 128 KiB (one argument's limit on Linux): read whole. This tiny model's context is 64
    tokens, so the prompt is refused, with its full length counted."""
    from freetoken.tokenizer import Tokenizer
    text = "the " * 50_000  # 200 KB
    fn = tmp_path / "big.txt"
    fn.write_text(text)
    n = len(Tokenizer((tiny / "hf" / "tokenizer.json").read_bytes()).encode(text))
    code, _, err = ft_here(capsys, "generate", str(tiny / "m.ftw"), "--prompt-file", str(fn))
    assert_one_line_error(code, err, f"{n} tokens", "context of 64")


def test_prompt_file_errors(tiny, tmp_path, capsys):
    code, _, err = ft_here(capsys, "generate", str(tiny / "m.ftw"), "--prompt-file", str(tmp_path / "absent.txt"))
    assert_one_line_error(code, err, "--prompt-file", "absent.txt", "No such file")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    code, _, err = ft_here(capsys, "generate", str(tiny / "m.ftw"), "--prompt-file", str(bad))
    assert_one_line_error(code, err, "latin1.txt", "not UTF-8")


def test_folder_with_several_ftw_files(tiny, tmp_path, capsys):
    d = tmp_path / "models"
    d.mkdir()
    for n in ("a.ftw", "b.ftw"):
        shutil.copy(tiny / "m.ftw", d / n)
    code, _, err = ft_here(capsys, "generate", str(d), "--prompt", "hi")
    assert_one_line_error(code, err, "2 .ftw files", "a.ftw, b.ftw", str(d / "a.ftw"))
    os.remove(d / "b.ftw")
    code, _, err = ft_here(capsys, "generate", str(d), "--prompt-ids", "1", "--max-tokens", "1")
    assert code == 0, err


def test_convert_creates_missing_folders(tiny, tmp_path, capsys):
    out = tmp_path / "new" / "deeper" / "m.ftw"
    code, _, err = ft_here(capsys, "convert", str(tiny / "hf"), str(out), "--quiet")
    assert code == 0, err
    assert out.exists() and f"created the folder {out.parent}" in err
    assert (tmp_path / "new" / "deeper").is_dir() and os.listdir(tmp_path / "new" / "deeper") == ["m.ftw"]
    # a path through a file: one line, nothing made
    (tmp_path / "afile").write_text("x")
    code, _, err = ft_here(capsys, "convert", str(tiny / "hf"), str(tmp_path / "afile" / "m.ftw"))
    assert_one_line_error(code, err, "afile")
