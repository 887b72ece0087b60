"""``python -m jtbo.generate`` end to end on the qwen3_moe fixture with its tokenizer.

A batch from ``--prompt`` and ``--prompts-file``, greedy in float32 with TBO on, must print
transformers' greedy continuation of every prompt (decoded with the same tokenizer), then
the token count, tokens/s and the TBO summary (the EP exchange is the peer copy's CPU twin).
The single-prompt stream and the argument errors are checked without a model.
"""

import io

import pytest

from jtbo.runner import generate_cli
from tests.models.hf import fixtures

tokenizers = pytest.importorskip("tokenizers")  # the `hf` extra (part of `test`)


def test_cli_serves_a_batch_and_matches_transformers(tmp_path):
    directory = fixtures.directory("qwen3_moe")
    reference = fixtures.reference("qwen3_moe")
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompts, greedy = reference["prompts"], reference["greedy_tokens"]
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text(f"{prompts[1]}\n\n{prompts[3]}\n")  # blank lines are skipped
    out = io.StringIO()
    argv = ["--model", str(directory), "--dtype", "float32", "--dp", "4", "--attn-tp", "2",
            "--prompt", prompts[0], "--prompts-file", str(prompts_file), "--tbo", "on",
            "--max-new-tokens", str(reference["max_new_tokens"]), "--ep-exchange", "peer_copy",
            "--dp-padding", "max_len"]  # fmt: skip
    assert generate_cli.main(argv, out=out) == 0
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


def test_cli_without_a_prompt_fails(capsys):
    directory = str(fixtures.directory("mixtral"))
    assert generate_cli.main(["--model", directory]) == generate_cli.EXIT_USAGE
    assert "no prompt" in capsys.readouterr().err
