"""The fingerprint's format and comparison (rft_contract.fingerprint), without torch."""

import json

import pytest

from rft_contract.fingerprint import RELATIVE, Fingerprint, compare, expected_for, parse_fingerprint

EXPORT = Fingerprint({
    "model.embed_tokens.weight": (12.5, 40.0, 1000.0),
    "model.layers.0.self_attn.q_proj.weight": (1.0, 2.0, 100.0),
    "model.layers.0.self_attn.k_proj.weight": (-0.5, 1.0, 50.0),
    "model.layers.0.self_attn.v_proj.weight": (0.25, 0.5, 50.0),
    "model.layers.0.mlp.down_proj.weight": (3.0, 9.0, 400.0),
}, "bf16", 7, {"lm_head.weight": "model.embed_tokens.weight"})
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def test_it_round_trips_and_bad_documents_are_named():
    assert parse_fingerprint(json.loads(EXPORT.to_json())) == EXPORT
    for bad, words in [({"format": "x"}, "not a rft.fingerprint/v1"),
                       ({"format": "rft.fingerprint/v1", "params": {}}, "params must map"),
                       ({"format": "rft.fingerprint/v1", "params": {"a": [1.0, 2.0]}}, "params['a']"),
                       ({"format": "rft.fingerprint/v1", "params": {"a": [1.0, float("nan"), 3]}}, "params['a']"),
                       ({"format": "rft.fingerprint/v1", "params": {"a": [1.0, 2.0, 0]}}, "params['a']"),
                       ({"format": "rft.fingerprint/v1", "params": {"a": [1, 2, 3]}, "tied": {"b": "c"}}, "tied")]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            parse_fingerprint(bad)


def test_an_engine_holding_the_export_passes_fused_and_tied_as_it_holds_them():
    held = {"model.embed_tokens.weight": (12.5, 40.0),
            "model.layers.0.self_attn.qkv_proj.weight": (0.75, 3.5),  # q, k and v in one tensor
            "model.layers.0.mlp.down_proj.weight": (3.0 + 1e-12, 9.0 * (1 + 1e-13)),  # another summation order
            "model.rotary_emb.inv_freq": (5.0, 5.0)}  # the engine's own: not compared
    verdict = compare(held, EXPORT, PACKED)
    assert verdict.ok and verdict.params == 3, verdict.describe()
    assert expected_for("model.layers.0.self_attn.qkv_proj.weight", EXPORT.params, PACKED)[0] == [
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight"]


def test_a_stale_tensor_a_stale_untied_head_and_a_missing_tensor_are_each_named():
    held = {"model.embed_tokens.weight": (12.5, 40.0),
            "lm_head.weight": (12.5, 40.0 * (1 + 1e-6)),  # an untied copy of the old embedding
            "model.layers.0.self_attn.qkv_proj.weight": (0.75, 3.5 * (1 + 100 * RELATIVE))}
    verdict = compare(held, EXPORT, PACKED)
    assert not verdict.ok
    assert [m.split(" ")[0] for m in verdict.mismatched] == ["lm_head.weight", "model.layers.0.self_attn.qkv_proj.weight"]
    assert verdict.missing == ["model.layers.0.mlp.down_proj.weight"]
    assert "2 of 3 parameters differ" in verdict.describe() and "1 exported tensors not held" in verdict.describe()
    assert verdict.record()["missing"] == ["model.layers.0.mlp.down_proj.weight"]


def test_the_sum_is_held_to_its_scale_too():
    """sqrt(n * sum of squares) bounds sum |x|: a moved sum is caught even when the sum of
    squares is unchanged (one value's sign flipped)."""
    held = {"model.layers.0.mlp.down_proj.weight": (3.0 - 2 * 0.5, 9.0)}
    assert not compare(held, EXPORT).ok


def test_without_the_packed_mapping_a_fused_tensor_accounts_for_nothing():
    held = {"model.layers.0.self_attn.qkv_proj.weight": (0.75, 3.5)}
    assert "model.layers.0.self_attn.q_proj.weight" in compare(held, EXPORT).missing
