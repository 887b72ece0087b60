"""``python -m jtbo.generate`` end to end on the qwen3_moe fixture with its tokenizer.

A batch from ``--prompt`` and ``--prompts-file``, greedy in float32 with TBO on, must print
transformers' greedy continuation of every prompt (decoded with the same tokenizer), then
the token count, tokens/s and the TBO summary (the EP exchange is the peer copy's CPU twin).
The single-prompt stream and the argument errors are checked without a model: each bad input
ends with its exit code (2 usage, 1 run error) and one error line naming the flag or file,
before any weights load.
"""

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jtbo.cli import generate as generate_cli
from tests.models.hf import fixtures

tokenizers = pytest.importorskip("tokenizers")  # the `hf` extra (part of `test`)


def test_cli_serves_a_batch_and_matches_transformers(tmp_path):
    directory = fixtures.directory("qwen3_moe")
    reference = fixtures.reference("qwen3_moe")
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompts, greedy = reference["prompts"], reference["greedy_tokens"]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"{prompts[1]}\n\n{prompts[3]}\n")  # blank lines are skipped
    out, err = io.StringIO(), io.StringIO()
    argv = ["--model", str(directory), "--dtype", "float32", "--dp", "4", "--attn-tp", "2",
            "--prompt", prompts[0], "--prompts-file", str(prompts_file), "--tbo", "on",
            "--max-new-tokens", str(reference["max_new_tokens"]), "--ep-exchange", "peer_copy",
            "--dp-padding", "max_len"]  # fmt: skip
    assert generate_cli.main(argv, out=out, err=err) == 0
    assert err.getvalue().splitlines()[0] == (
        "python -m jtbo.generate: 8 cpu devices (cpu) | mesh dp=4 x attn_tp=2 | attention native | "
        "experts xla | MoE ep, exchange peer_copy | TBO on | float32"
    )
    lines = out.getvalue().splitlines()
    want = {f"[{i}] {prompts[j]}{tokenizer.decode(greedy[j])}" for i, j in enumerate((0, 1, 3))}
    assert set(lines[:3]) == want
    assert lines[3].startswith(f"{3 * reference['max_new_tokens']} tokens in ")
    assert "tokens/s" in lines[3]
    assert lines[4].startswith("TBO on ") and "enable_two_batch_overlap=True" in lines[4]


def test_single_prompt_text_streams_token_by_token():
    tokenizer = tokenizers.Tokenizer.from_file(
        str(fixtures.directory("mixtral") / "tokenizer.json")
    )
    ids = tokenizer.encode(" brown fox jumps").ids
    out = io.StringIO()
    streamer = generate_cli._Streamer(tokenizer, ["The quick"], len(ids), out)
    seen = []
    for token in ids:
        streamer(0, token)
        seen.append(out.getvalue())
    assert seen[-1] == " brown fox jumps"
    assert all(a != b and b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))


def _model_copy(tmp_path: Path, config_text: str | None) -> Path:
    """The mixtral fixture's directory with its config.json replaced (None: removed)."""
    copy = tmp_path / "model"
    shutil.copytree(fixtures.directory("mixtral"), copy)
    if config_text is None:
        (copy / "config.json").unlink()
    else:
        (copy / "config.json").write_text(config_text)
    return copy


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], int, str]]:
    """name -> (argv, exit code, text the error line holds)."""
    model = str(fixtures.directory("mixtral"))
    prompt = ["--model", model, "--prompt", "Hello"]
    return {
        "no such model": (["--model", str(tmp_path / "nope"), "--prompt", "x"], 2,
                          "argument --model: "),
        "no config.json": (["--model", str(_model_copy(tmp_path / "a", None)), "--prompt", "x"],
                           2, "no config.json"),
        "malformed config.json": (
            ["--model", str(_model_copy(tmp_path / "b", "{not json")), "--prompt", "x"], 1,
            "config.json: not valid JSON",
        ),
        "no new tokens": ([*prompt, "--max-new-tokens", "0"], 2,
                          "argument --max-new-tokens: must be >= 1, got 0"),
        "no prompts file": ([*prompt, "--prompts-file", str(tmp_path / "p.txt")], 2,
                            "argument --prompts-file: "),
        "negative temperature": ([*prompt, "--temperature", "-1"], 2,
                                 "argument --temperature: must be >= 0"),
        "top-p above one": ([*prompt, "--top-p", "1.5"], 2, "argument --top-p: must be in"),
        "no attention TP": ([*prompt, "--attn-tp", "0"], 2, "argument --attn-tp: must be >= 1"),
        "too many devices": ([*prompt, "--dp", "16"], 2, "needs 16 devices; this host has 8"),
        "triton on a CPU": ([*prompt, "--attention-backend", "triton"], 2,
                            "--attention-backend triton cannot run here: jax-triton runs on GPUs"),
        "experts over DP": ([*prompt, "--dp", "3"], 2, "does not divide over 3 devices"),
        "unknown TBO": ([*prompt, "--tbo", "maybe"], 2, "argument --tbo: invalid choice"),
        "empty prompt": (["--model", model, "--prompt", ""], 2, "--prompt number 1 is empty"),
        "blank prompts file": (["--model", model, "--prompts-file", str(tmp_path / "blank.txt")],
                               2, "no prompt"),
    }  # fmt: skip


def _run(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    try:
        code = generate_cli.main(argv, out=io.StringIO(), err=err)
    except SystemExit as exit_info:  # argparse's usage errors
        code = exit_info.code
    return code, err.getvalue()


def test_every_bad_input_ends_with_one_error_line_and_its_exit_code(tmp_path, capsys):
    (tmp_path / "blank.txt").write_text("\n  \n")
    for name, (argv, code, text) in _bad_inputs(tmp_path).items():
        got_code, err = _run(argv)
        err += capsys.readouterr().err
        lines = err.strip().splitlines()
        assert (got_code, len(lines)) == (code, 1), (name, got_code, err)
        assert text in lines[0] and lines[0].startswith("python -m jtbo.generate: error: "), name
        assert "Traceback" not in err, name


def test_the_command_refuses_a_kernel_before_jax_loads_the_model(tmp_path):
    """``python -m jtbo.generate`` as a user runs it (its own platform choice, no conftest)."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    argv = ["--model", str(fixtures.directory("mixtral")), "--prompt", "Hello", "--dp", "2",
            "--attention-backend", "triton"]  # fmt: skip
    if generate_cli.impls.backend() != "cpu":
        pytest.skip("checks the refusal of the Triton kernels on a CPU-only host")
    run = subprocess.run([sys.executable, "-m", "jtbo.generate", *argv], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        "python -m jtbo.generate: error: --attention-backend triton cannot run here: "
        "jax-triton runs on GPUs only; the backend is cpu"
    ]


def test_cli_without_a_prompt_fails():
    directory = str(fixtures.directory("mixtral"))
    code, err = _run(["--model", directory])
    assert code == generate_cli.EXIT_USAGE
    assert "no prompt" in err
