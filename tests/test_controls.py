"""Per-request speculation controls (SamplingParams.extra_args / vllm_xargs): parsed, or refused naming the key."""

import pytest

from vllm_adaspec.controls import DEFAULT, MAX_DRAFTS, SPECULATION, ControlError, RequestControls, parse_controls


def test_defaults_and_other_components_keys_are_left_alone():
    assert parse_controls(None) == DEFAULT and parse_controls({}) == DEFAULT
    assert parse_controls({"kv_transfer_params": {"x": 1}}) == DEFAULT
    assert not DEFAULT.off


@pytest.mark.parametrize("args, want", [
    ({SPECULATION: "off"}, RequestControls("off")),
    ({SPECULATION: "chain", MAX_DRAFTS: 3}, RequestControls("chain", 3)),
    ({SPECULATION: "tree"}, RequestControls("tree")),
    ({MAX_DRAFTS: "4"}, RequestControls("auto", 4)),  # vllm_xargs may carry numbers as strings
    ({MAX_DRAFTS: 0}, RequestControls("auto", 0)),
])
def test_valid_controls(args, want):
    assert parse_controls(args) == want
    assert parse_controls({SPECULATION: "off"}).off and parse_controls({MAX_DRAFTS: 0}).off


@pytest.mark.parametrize("args, key", [
    ({SPECULATION: "sometimes"}, SPECULATION),
    ({SPECULATION: 1}, SPECULATION),
    ({MAX_DRAFTS: -1}, MAX_DRAFTS),
    ({MAX_DRAFTS: 129}, MAX_DRAFTS),
    ({MAX_DRAFTS: 2.5}, MAX_DRAFTS),
    ({MAX_DRAFTS: True}, MAX_DRAFTS),
    ({MAX_DRAFTS: "many"}, MAX_DRAFTS),
    ({"adaspec_budget": 3}, "adaspec_budget"),  # a typo must not silently change nothing
])
def test_bad_controls_are_refused_naming_the_key(args, key):
    with pytest.raises(ControlError) as e:
        parse_controls(args)
    assert e.value.key == key and key in str(e.value)
