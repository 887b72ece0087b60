"""The ep_routing_stats file: round trip, model check, and errors naming the field."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.collectives import ep_config
from jtbo.collectives import mesh as mesh_lib
from jtbo.runner import ep_stats_file

MODEL = ep_stats_file.model_key(num_experts=16, top_k=2, ep_size=8, dedup=False)
peaks_strategy = st.dictionaries(
    st.integers(1, 1 << 20), st.tuples(st.integers(0, 1 << 20), st.integers(0, 1 << 20)),
    max_size=6,
)  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(peaks_strategy)
def test_round_trip(peaks):
    content = json.loads(json.dumps(ep_stats_file.to_json(MODEL, peaks)))
    assert ep_stats_file.from_json(content, MODEL) == peaks


def test_save_and_load_name_the_file(tmp_path):
    path = tmp_path / "stats.json"
    ep_stats_file.save(path, MODEL, {64: (40, 70), 8: (5, 9)})
    assert ep_stats_file.load(path, MODEL) == {8: (5, 9), 64: (40, 70)}
    other = dict(MODEL, ep_size=4)
    with pytest.raises(ValueError, match=r"stats.json: ep_routing_stats field 'model'"):
        ep_stats_file.load(path, other)


@pytest.mark.parametrize(
    "content, message",
    [
        ([], "expected a JSON object"),
        ({"version": 2, "model": MODEL, "peaks": []}, "field 'version'"),
        ({"version": 1, "model": MODEL}, "field 'peaks': missing"),
        ({"version": 1, "model": MODEL, "peaks": [3]}, r"'peaks\[0\]': expected an object"),
        ({"version": 1, "model": MODEL, "peaks": [{"rows": 0, "peer": 1, "expert": 1}]},
         r"peaks\[0\].'rows'"),
        ({"version": 1, "model": MODEL, "peaks": [{"rows": 4, "peer": -1, "expert": 1}]},
         r"peaks\[0\].'peer'"),
        ({"version": 1, "model": MODEL, "peaks": [{"rows": 4, "peer": 1, "expert": True}]},
         r"peaks\[0\].'expert'"),
        ({"version": 1, "model": MODEL,
          "peaks": [{"rows": 4, "peer": 1, "expert": 1, "when": 3}]}, "'when': unexpected"),
        ({"version": 1, "model": MODEL, "peaks": [{"rows": 4, "peer": 1, "expert": 1}] * 2},
         "listed twice"),
    ],
)  # fmt: skip
def test_bad_files_name_the_field(content, message):
    with pytest.raises(ValueError, match=message):
        ep_stats_file.from_json(content, MODEL)


def test_sized_from_peaks_rounds_and_caps_at_the_worst_case():
    base = ep_config.create_ep_dispatcher(
        mesh_lib.make_mesh(8, 1), num_experts=16, num_tokens=10, top_k=2
    )
    sized = ep_config.sized_from_peaks(base, 5, 13, headroom=1.5, slot_alignment=4)
    assert (sized.peer_capacity, sized.expert_capacity) == (8, 20)  # ceil(7.5)->8, ceil(19.5)->20
    capped = ep_config.sized_from_peaks(base, 10**6, 10**6, headroom=1.0, slot_alignment=1)
    assert capped.peer_capacity == capped.worst_peer_capacity == 20
    assert capped.expert_capacity == capped.worst_expert_capacity
    with pytest.raises(ValueError, match="headroom"):
        ep_config.sized_from_peaks(base, 1, 1, headroom=0.5, slot_alignment=1)
