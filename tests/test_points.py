"""Point ids, order, groups and layer selections: owned by `points`, built and parsed there only."""

from __future__ import annotations

import pytest

from pytest_moe_parity.points import (
    COMPONENTS,
    LAYER_COMPONENTS,
    ROUTED_BLOCKS,
    Point,
    describe_layers,
    parse_layers,
    parse_point_id,
    point_id,
)


def test_ids_round_trip() -> None:
    assert point_id("attention", 17) == "layer_17.attention"
    assert point_id("logits") == "logits"
    assert point_id("router", 3, step=2) == "step_2.layer_3.router"
    for pid in ("embedding", "layer_0.input_norm", "layer_61.shared_experts", "step_12.layer_3.moe", "step_1.logits"):
        step, layer, component = parse_point_id(pid)
        assert point_id(component, layer, step) == pid
        assert Point.parse(pid).id == pid


@pytest.mark.parametrize("bad", ["layer_x.attention", "layer_3.warp", "attention", "layer_2", "", "Layer_1.moe"])
def test_bad_ids(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_point_id(bad)


def test_point_fields() -> None:
    moe = Point("moe", 4, module="model.layers.4.mlp", order=30, step=2)
    assert (moe.id, moe.group, moe.routed_block, moe.router_id) == (
        "step_2.layer_4.moe", "step_2.layer_4", True, "step_2.layer_4.router",
    )  # fmt: skip
    assert Point("logits").group == "logits" and Point("logits").router_id is None
    assert not Point("experts", 1).routed_block and Point("output", 1).routed_block
    assert set(ROUTED_BLOCKS) == {"moe", "output"} and set(ROUTED_BLOCKS) <= set(LAYER_COMPONENTS)
    assert Point.from_dict(moe.to_dict()) == moe
    with pytest.raises(ValueError, match="does not match"):
        Point.from_dict({**moe.to_dict(), "id": "layer_5.moe"})
    with pytest.raises(ValueError, match="unknown component"):
        Point("warp", 1)
    with pytest.raises(ValueError, match="does not fit"):
        Point("attention")  # a layer component needs its layer
    with pytest.raises(ValueError, match="does not fit"):
        Point("logits", 3)


def test_forward_order_puts_parts_before_wholes() -> None:
    order = COMPONENTS.index
    assert order("embedding") < order("input_norm") < order("attention") < order("router") < order("experts")
    assert order("experts") < order("moe") < order("output") < order("final_norm") < order("logits")


def test_layer_selections() -> None:
    assert parse_layers("1,17,20-23") == [1, 17, 20, 21, 22, 23]
    assert parse_layers(" 3 , 3,2-3") == [2, 3]
    for bad, message in [("x", "not a layer number"), ("3-1", "not a range"), ("-2", "not a"), (",", "no layer")]:
        with pytest.raises(ValueError, match=message):
            parse_layers(bad)
    assert describe_layers([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert describe_layers([4]) == "4"
