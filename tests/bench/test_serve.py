"""``python -m jtbo.bench serve``: the flags, the step statistics and the agreement on synthetic
input, and CPU smoke runs (a preset over two DP ranks with ``--json``, ``--mixed-chunk`` and
``--hf-config``).
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from jtbo.bench import serve
from jtbo.runner import generate as generate_lib

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hf"
TABLE_ROWS = [name for name, _ in serve._rows(serve.step_stats([1.0], [[]], 1), None)]


Record = generate_lib.StepRecord


def _table(out: str) -> dict[str, str]:
    """The table's jtbo column by measure."""
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ")]
    return {name.strip(): value.strip() for name, value, *_ in rows[1:]}


def test_preset_over_two_ranks_prints_the_table_and_consistent_json(capsys):
    serve.main(["--preset", "tiny", "--prompts", "3", "--prompt-len", "8", "--max-new-tokens",
                "3", "--iters", "1", "--chunk-size", "32", "--devices", "2", "--json"])  # fmt: skip
    out = capsys.readouterr().out
    lines = out.splitlines()
    result = json.loads(lines[-1])
    title = next(line for line in lines if line.startswith("serve: "))
    assert title.startswith("serve: tiny: hidden 64, 3 layers, 8 experts top-2")
    assert "3 prompts x 8 tokens + 3 new; pool 22 slots/rank, rows 3" in title
    assert "TBO off; dp 2" in title
    assert list(_table(out)) == TABLE_ROWS
    jtbo = result["jtbo"]
    # Both ranks prefill in one step (2 and 1 prompts, 16 and 8 tokens <= the chunk), each
    # decode step makes one token per prompt: T - 1 decode steps.
    assert jtbo["steps"] == {"extend": 1, "decode": 2, "mixed": 0}
    assert jtbo["peak_running"] == 3
    assert (result["pool"], result["rows"], result["dp"]) == (22, 3, 2)
    for name in ("generate_s", "prefill_tokens_per_s", "decode_tokens_per_s", "decode_host_ms"):
        assert jtbo[name] > 0
    device = result["device_step"]
    assert 0 < device["host_ms"] < device["run_plan_ms"]  # run_plan's host part is inside it
    assert device["step_ms"] > 0
    assert jtbo["output_tokens_per_s"] == pytest.approx(9 / jtbo["generate_s"])
    # Two decode steps of 3 tokens: the rate is 3 tokens over their median (= mean) wall.
    assert jtbo["decode_tokens_per_s"] == pytest.approx(3e3 / jtbo["decode_step_ms"])
    assert float(_table(out)["decode step wall / device step"]) == pytest.approx(
        jtbo["decode_step_ms"] / device["step_ms"], rel=0.01
    )
    assert result["transformers"] is None


def test_mixed_chunk_runs_a_prompt_chunk_beside_a_decode(capsys):
    # Two prompts of 8 tokens, chunks of 10: the first step prefills A and 2 tokens of B; the
    # second decodes A and prefills B's other 6 in one MIXED step; then both decode.
    # The routed experts are FP8 here (--expert-dtype): the steps do not depend on them.
    serve.main(["--preset", "tiny", "--prompts", "2", "--prompt-len", "8", "--max-new-tokens",
                "3", "--iters", "1", "--chunk-size", "10", "--mixed-chunk", "--expert-dtype",
                "float8_e4m3fn", "--json"])  # fmt: skip
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["jtbo"]["steps"] == {"extend": 1, "decode": 2, "mixed": 1}
    assert (result["dtype"], result["expert_dtype"]) == ("bfloat16", "float8_e4m3fn")


def test_hf_config_is_mapped_and_cut_to_num_layers(tmp_path, capsys):
    raw = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    raw["mlp_only_layers"] = [1, 2]  # layer 2 is cut away
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    serve.main(["--hf-config", str(path), "--num-layers", "2", "--prompts", "2",
                "--prompt-len", "4", "--max-new-tokens", "2", "--iters", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert f"serve: {path} (qwen3_moe): hidden 48, 2 layers, 8 experts top-2" in out
    table = _table(out)
    assert table["steps extend / decode / mixed"] == "1 / 1 / 0"
    assert float(table["prefill tokens/s"]) > 0 and float(table["decode tokens/s"]) > 0


def test_peer_without_torch_exits_naming_the_module(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        serve.main(["--model", str(FIXTURES / "qwen3_moe"), "--peer", "transformers"])
    assert exit_info.value.code == serve.EXIT_NO_PEER
    assert "needs the `torch` module" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-layers", "2"], "--num-layers applies to --hf-config only"),
        (["--peer", "transformers"], "--peer transformers needs a checkpoint"),
        (["--preset", "tiny", "--model", "x"], "not allowed with argument"),
        (["--prompts", "0"], "must be >= 1, got 0"),
        (["--hf-config", "/no/such/config.json"], "no such file"),
        (["--model", "/no/such/dir"], "no config.json"),
        (["--temperature", "-1"], "--temperature: must be >= 0, got -1"),
        (["--top-p", "0"], "--top-p: must be in (0, 1], got 0"),
        (["--dtype", "float32", "--expert-dtype", "bfloat16"], "expert_dtype='bfloat16'"),
        (
            [
                "--model",
                str(FIXTURES / "qwen3_moe"),
                "--peer",
                "transformers",
                "--temperature",
                "1",
            ],
            "compares greedy tokens",
        ),
    ],
)
def test_bad_flags_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unsupported_hf_config_is_a_flag_error(tmp_path, capsys):
    raw = json.loads((FIXTURES / "qwen3_moe" / "config.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(raw, hidden_act="gelu")))
    with pytest.raises(SystemExit):
        serve.main(["--hf-config", str(path)])
    assert "hidden_act" in capsys.readouterr().err


def test_step_stats_rates_medians_counts_and_peak():
    logs = [
        [Record("extend", 60, 3, 0.01, 0.5), Record("mixed", 21, 4, 0.01, 0.2)]
        + [Record("decode", 4, 4, 0.002, wall) for wall in (0.01, 0.03, 0.02)],
        [Record("extend", 60, 3, 0.01, 0.7)] + [Record("decode", 4, 4, 0.004, 0.04)],
    ]
    stats = serve.step_stats([2.0, 4.0, 3.0], logs, output_tokens=24)
    assert stats.generate_s == 3.0 and stats.output_tokens_per_s == 8.0
    assert stats.prefill_tokens_per_s == pytest.approx(120 / 1.2)
    assert stats.decode_tokens_per_s == pytest.approx(16 / 0.1)
    assert stats.decode_step_ms == pytest.approx(25.0)  # median of 10, 20, 30, 40 ms
    assert stats.decode_host_ms == pytest.approx(2.0)
    assert stats.steps == {"extend": 1, "decode": 3, "mixed": 1}  # the first call's
    assert stats.peak_running == 4
    no_decode = serve.step_stats([1.0], [[Record("extend", 8, 1, 0.1, 0.5)]], output_tokens=1)
    assert no_decode.decode_tokens_per_s is None and no_decode.decode_step_ms is None


def test_agreement_first_token_every_token_whole_prompts():
    got = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]])
    want = np.array([[1, 2, 3], [4, 5, 0], [0, 8, 9], [1, 1, 1]])
    assert serve.agreement(got, want) == (0.75, 10 / 12, 0.5)


def test_peer_summary_ratios_are_transformers_wall_over_jtbo_wall():
    stats = serve.step_stats([2.0], [[Record("extend", 40, 4, 0.1, 0.5)]], output_tokens=8)
    tokens = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
    peer = serve.PeerRun(6.0, 1.0, tokens, "grouped_mm", "cpu")
    summary = serve.peer_summary(peer, stats, prompts=4, prompt_len=10, tokens=tokens)
    assert summary["generate_speedup"] == 3.0
    assert summary["prefill_speedup"] == pytest.approx(80 / 40)  # 80 vs 40 prefill tokens/s
    assert summary["token_agreement"] == summary["prompt_agreement"] == 1.0
    table = serve.table([("generate wall (s)", 2.0), ("peak running sequences", 4)], summary)
    assert "| generate wall (s) | 2 | 6 | 3.000 |" in table
    assert "| greedy agreement: first token / all tokens / whole prompts | - | 1.000 / " in table


def test_cpu_device_count_is_set_before_the_backend_starts():
    args = serve._parser().parse_args(["--devices", "4"])
    environ = {"XLA_FLAGS": "--a=1"}
    serve.configure_environment(args, environ)
    assert environ["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=4"
    assert environ["NCCL_NVLS_ENABLE"] == "0"
    kept = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    serve.configure_environment(args, kept)
    assert kept["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
