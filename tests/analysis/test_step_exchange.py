"""The step model's EP exchange: row bytes, topologies, distinct GPUs and nodes per token."""

import dataclasses
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jtbo.analysis import step_exchange
from jtbo.models import config as config_lib

V3 = config_lib.MoEConfig.deepseek_v3()
CONFIGS = st.sampled_from([
    V3,
    dataclasses.replace(V3, n_group=4, topk_group=2),
    dataclasses.replace(V3, n_group=16, topk_group=8),
    dataclasses.replace(V3, n_group=32, topk_group=4),
    dataclasses.replace(V3, n_group=1, topk_group=1),
    dataclasses.replace(V3, num_experts_per_tok=2),  # fewer picks than chosen groups
    config_lib.MoEConfig.deepseek_v3_gqa_reduced(),
    config_lib.MoEConfig.tiny(),
    config_lib.MoEConfig.tiny_softmax(),
])  # fmt: skip


@st.composite
def _groups(draw):
    """``(ep_size, gpus_per_node)``: whole nodes, or one node with fewer GPUs than a node."""
    per_node = draw(st.sampled_from([1, 2, 4, 8]))
    nodes = draw(st.integers(1, 16))
    ep = per_node * nodes if draw(st.booleans()) else draw(st.integers(1, per_node))
    return ep, per_node


def _node(per_node: int, topology: str = "node", dtype: str = "bf16") -> step_exchange.Exchange:
    return step_exchange.Exchange(dtype, "bf16", topology, per_node, 300.0)


@given(st.integers(1, 128))
def test_fp8_rows_are_bf16_rows_times_a_scale_per_block_over_two(blocks):
    hidden = 128 * blocks
    bf16, fp8 = step_exchange.row_bytes("bf16", hidden), step_exchange.row_bytes("fp8", hidden)
    assert fp8 == bf16 * (1 + 4 / 128) / 2


@settings(max_examples=30, deadline=None)
@given(_groups(), st.sampled_from(["flat", "node", "pairs"]), st.floats(1.0, 4.0))
def test_fp8_dispatch_moves_the_fp8_share_of_the_row_bytes(group, topology, imbalance):
    ep, per_node = group
    exchange = step_exchange.Exchange() if topology == "flat" else _node(per_node, topology)
    routing = step_exchange.routing_for(V3, ep, imbalance)
    tokens = 1000.0
    rows = step_exchange.exchange_rows(V3, tokens, routing, exchange)
    header = (
        step_exchange.PAIR_HEADER_BYTES if topology == "pairs" else step_exchange.ROUTE_BYTES * 8
    )
    bf16 = step_exchange.exchange_bytes(V3, tokens, routing, exchange)["dispatch"]
    fp8 = step_exchange.exchange_bytes(
        V3, tokens, routing, dataclasses.replace(exchange, dispatch_dtype="fp8")
    )["dispatch"]
    for leg, count in zip(("link_bytes", "nvlink_bytes"), rows, strict=True):
        payload = getattr(bf16, leg) - count * header
        assert getattr(fp8, leg) - count * header == pytest.approx(
            payload * (1 + 4 / 128) / 2, rel=1e-12, abs=1e-6
        )


@settings(max_examples=60, deadline=None)
@given(CONFIGS, _groups())
def test_distinct_nodes_per_token_are_between_one_and_top_k(config, group):
    ep, per_node = group
    _, nodes = step_exchange.node_shape(ep, per_node)
    distinct = step_exchange.nodes_per_token(config, ep, per_node)
    assert 1 - 1e-9 <= distinct <= min(config.num_experts_per_tok, nodes) + 1e-9
    remote = step_exchange.remote_nodes_per_token(config, ep, per_node)
    assert remote == pytest.approx(distinct * (nodes - 1) / nodes)


@settings(max_examples=60, deadline=None)
@given(CONFIGS, _groups(), st.floats(1.0, 4.0), st.sampled_from(["bf16", "fp8"]))
def test_node_topology_never_sends_more_over_the_link_than_flat(config, group, load, dtype):
    ep, per_node = group
    if dtype == "fp8" and config.hidden_size % step_exchange.FP8_BLOCK:
        dtype = "bf16"  # tiny rows cannot be FP8
    routing = step_exchange.routing_for(config, ep, load)
    tokens = 512.0
    flat = step_exchange.exchange_bytes(config, tokens, routing, step_exchange.Exchange(dtype))
    node = step_exchange.exchange_bytes(config, tokens, routing, _node(per_node, dtype=dtype))
    for name in ("dispatch", "combine"):
        assert node[name].link_bytes <= flat[name].link_bytes * (1 + 1e-12)


def _miss(total: int, removed: int, k: int) -> float:
    return math.comb(total - removed, k) / math.comb(total, k)


def test_deepseek_v3_at_ep32_over_nodes_of_8():
    # 8 groups of 32 experts, 2 groups per node: the token chose j of the node's groups with
    # probability C(2, j) C(6, 4 - j) / C(8, 4), and then one of its 8 picks among the chosen
    # groups' 128 experts lands in the node's 32 j of them
    hit = sum(
        math.comb(2, j) * math.comb(6, 4 - j) / math.comb(8, 4) * (1 - _miss(128, 32 * j, 8))
        for j in (1, 2)
    )
    assert step_exchange.node_hit_probability(V3, 32, 8) == pytest.approx(hit)
    assert step_exchange.remote_nodes_per_token(V3, 32, 8) == pytest.approx(3 * hit)
    # a block inside one group: the GPU count's own formula
    gpu = step_exchange.gpu_hit_probability(V3, 32, 8)
    assert step_exchange.grouped_hit_probability(V3, 256, 8) == pytest.approx(gpu)


@settings(max_examples=20, deadline=None)
@given(_groups(), st.integers(1, 4096))
def test_pairs_send_every_other_gpus_pair_once(group, tokens):
    ep, per_node = group
    routing = step_exchange.routing_for(V3, ep)
    link, nvlink = step_exchange.exchange_rows(V3, tokens, routing, _node(per_node, "pairs"))
    assert link + nvlink == pytest.approx(tokens * 8 * (ep - 1) / ep)
    assert nvlink == pytest.approx(tokens * 8 * (min(per_node, ep) - 1) / ep)


def test_an_exchange_takes_its_longer_leg_plus_the_latency():
    link = step_exchange.Link(50.0, latency_us=20.0)
    node = _node(8)
    assert step_exchange.exchange_ms(link, node, step_exchange.Traffic(5e7, 3e8)) == pytest.approx(
        1.02
    )
    assert step_exchange.exchange_ms(link, node, step_exchange.Traffic(1e8, 3e8)) == pytest.approx(
        2.02
    )
    assert step_exchange.exchange_ms(link, node, step_exchange.Traffic(0.0, 0.0)) == 0.0
    flat = step_exchange.Exchange()
    assert step_exchange.exchange_ms(link, flat, step_exchange.Traffic(1e8)) == link.exchange_ms(
        1e8
    )


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="row dtypes"):
        step_exchange.Exchange("fp16")
    with pytest.raises(ValueError, match="topology"):
        step_exchange.Exchange(topology="ring")
    with pytest.raises(ValueError, match="needs gpus_per_node"):
        step_exchange.Exchange(topology="node")
    with pytest.raises(ValueError, match="no NVLink leg"):
        step_exchange.Exchange(gpus_per_node=8)
    with pytest.raises(ValueError, match="whole number"):
        step_exchange.node_shape(12, 8)
    with pytest.raises(ValueError, match="multiple of 128"):
        step_exchange.row_bytes("fp8", 100)


@pytest.mark.parametrize("block", [1, 2, 3, 4, 6, 12])
def test_grouped_hit_probability_counts_every_choice(block):
    # tiny: 2 of 4 groups, 2 picks; 12 slots in groups of 3, tiled by blocks that fall
    # inside, across and around groups: count every choice of groups and picks
    tiny, slots, size = config_lib.MoEConfig.tiny(), 12, 3
    hits = outcomes = 0
    for groups in itertools.combinations(range(4), 2):
        candidates = [g * size + i for g in groups for i in range(size)]
        for picks in itertools.combinations(candidates, 2):
            blocks = {p // block for p in picks}
            hits, outcomes = hits + len(blocks), outcomes + slots // block
    exact = hits / outcomes
    assert step_exchange.grouped_hit_probability(tiny, slots, block) == pytest.approx(exact)
