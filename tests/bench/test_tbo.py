"""``python -m jtbo.bench tbo``: the synthetic decode context and a CPU smoke run."""

import numpy as np

from jtbo.bench import tbo
from jtbo.runner import kv_table


def test_decode_context_has_its_own_slots_never_the_padding_slot():
    seqs, context = 5, 7
    batch = tbo._decode_batch(seqs, context, vocab=64)
    table = np.zeros((seqs, context + 3), np.int32)
    kv_table.record(table, tbo._decode_prefix(batch), num_slots=seqs * context + 1)
    kv_table.record(table, batch, num_slots=seqs * context + 1)
    want = np.arange(seqs)[:, None] * context + 1 + np.arange(context)[None, :]
    np.testing.assert_array_equal(table[:, :context], want)
    assert len(np.unique(table[:, :context])) == seqs * context  # distinct, none is slot 0


def test_tiny_run_prints_every_case_with_agreement(capsys):
    tbo.main(["--tiny", "--prefill", "128", "--decode", "32", "--context", "8", "--iters", "1",
              "--dtype", "float32"])  # fmt: skip
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in lines[1:]] == ["prefill 128", "decode 32"]
    for line in lines[1:]:
        median_row, same_token = line.split("|")[-2].split(" / ")
        assert float(median_row) < 1e-5 and float(same_token) == 1.0, line  # float32 on the CPU


def test_profile_traces_plain_and_tbo_steps(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", "")  # restored afterwards: --profile adds dump flags
    tbo.main(["--tiny", "--prefill", "128", "--decode", "32", "--context", "8", "--iters", "1",
              "--profile", str(tmp_path)])  # fmt: skip
    for case in ("prefill_128", "decode_32"):
        for kind in ("plain", "tbo"):
            assert list((tmp_path / f"{case}_{kind}").glob("**/*.trace.json.gz")), (case, kind)
    assert "--xla_dump_to" in tbo.os.environ["XLA_FLAGS"]
    assert "kernel attribution needs a GPU trace" in capsys.readouterr().out  # CPU run
