"""``--variant NAME=SPEC``: parsing, the outside settings, and the runs in subprocesses
(three variants, one failing on purpose, one in free windows)."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jtbo.bench import overlap
from jtbo.bench.overlap import cli
from jtbo.overlap import xla_options
from tests.bench.overlap import runs

_WORD = st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True).filter(
    lambda word: xla_options._parse_value(word) == word  # not read back as bool / number
)
_XLA_VALUES = st.one_of(
    st.integers(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), _WORD
)
_XLA = st.lists(st.tuples(st.from_regex(r"xla_[a-z_]{1,12}", fullmatch=True), _XLA_VALUES),
                max_size=3, unique_by=lambda item: item[0])  # fmt: skip
_ENV = st.lists(
    st.tuples(st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True),
              st.from_regex(r"[A-Za-z0-9_=:./ -]{0,12}", fullmatch=True).map(str.strip)),
    max_size=3, unique_by=lambda item: item[0],
)  # fmt: skip


@given(st.from_regex(r"[A-Za-z0-9_.-]{1,10}", fullmatch=True), _XLA, _ENV,
       st.sampled_from([None, *overlap.WINDOW_MODES]))  # fmt: skip
def test_variant_spec_round_trips(name, xla, env, windows):
    variant = overlap.Variant(name, tuple(xla), tuple(env), windows)
    assert overlap.parse_variant(f"{name}={variant.spec()}") == variant


@pytest.mark.parametrize(
    "text", ["noequals", "=env:A=1", "a b=", "v=tpu:A=1", "v=env:A", "v=env:A=1,", "v=xla:=1",
             "v=env:A=1,env:A=2", "v=opt:windows=fast", "v=opt:chain=3", "v=opt:windows",
             "v=opt:windows=free,opt:windows=pinned"],
)  # fmt: skip
def test_malformed_variants_are_rejected(text):
    with pytest.raises(ValueError):
        overlap.parse_variant(text)


def test_variants_take_the_outside_settings_and_override_them():
    args = cli.parser().parse_args([
        "--xla-option", "xla_a=1", "--env", "E=outer", "--variant", "plain=",
        "--variant", "mine=env:E=inner,xla:xla_b=true",
    ])  # fmt: skip
    plain, mine = overlap.variants_of(args)
    assert plain == overlap.Variant("plain", (("xla_a", 1),), (("E", "outer"),))
    assert mine == overlap.Variant("mine", (("xla_a", 1), ("xla_b", True)), (("E", "inner"),))
    with pytest.raises(ValueError, match="differ"):
        overlap.variants_of(cli.parser().parse_args(["--variant", "a=", "--variant", "a="]))


def test_variants_run_in_subprocesses_and_a_failing_one_is_reported(capsys):
    """SUBPROCESSES, ~10 s: three children in turn: defaults; env + a compile option (its
    XLA_FLAGS reach the child's backend: 4 devices instead of the 8 this process has) + free
    windows; an unknown compile option, which must fail visibly."""
    with pytest.raises(SystemExit, match=r"1 of 3 variant\(s\) failed: \['bad'\]"):
        overlap.main([*runs.TINY, "--collectives", "all_to_all,psum_scatter",
                      "--variant", "plain=",
                      "--variant", "knobs=env:CUDA_DEVICE_MAX_CONNECTIONS=1,"
                      "env:XLA_FLAGS=--xla_force_host_platform_device_count=4,"
                      "xla:xla_gpu_use_memcpy_local_p2p=true,opt:windows=free",
                      "--variant", "bad=xla:no_such_option=1"])  # fmt: skip
    out = capsys.readouterr().out
    rows = runs.table_rows(out)
    measured = [(row[0], row[1]) for row in rows if not row[1].startswith("FAILED")]
    assert measured == [(v, c) for v in ("plain", "knobs") for c in ("all_to_all", "psum_scatter")]
    assert [row[2] for row in rows[:4]] == ["pinned"] * 2 + ["free"] * 2  # --windows, opt:
    for row in rows[:4]:
        runs.assert_measured(row)
    assert rows[4][0] == "bad" and "No such compile option" in rows[4][1], rows[4]
    assert "variant knobs (xla:xla_gpu_use_memcpy_local_p2p=true,env:CUDA_DEVICE_MAX" in out
    assert re.search(r"variant knobs \(.*,opt:windows=free\): 4 x cpu.* windows free;", out)
    assert re.search(r"variant plain \(defaults\): 8 x cpu", out)
    assert "variant bad failed" in out  # with its stderr tail
