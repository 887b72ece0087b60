"""Bench flags derived from an options dataclass parse back into it."""

import argparse
import dataclasses

import pytest

from jtbo.bench import attention, options


def test_flags_come_from_the_fields_and_parse_back_into_them():
    parser = argparse.ArgumentParser()
    options.add_arguments(parser, attention.CaseOptions)
    parsed = parser.parse_args(["--small", "--q-heads", "8", "--cases", "decode"])
    got = options.from_namespace(attention.CaseOptions, parsed)
    want = dataclasses.replace(attention.CaseOptions(), small=True, q_heads=8, cases="decode")
    assert got == want
    with pytest.raises(SystemExit):
        parser.parse_args(["--q-heads", "0"])  # the field's argument type refuses it


def test_a_field_without_option_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Plain:
        x: int = 1

    with pytest.raises(ValueError, match="Plain.x is not an option"):
        options.add_arguments(argparse.ArgumentParser(), Plain)
