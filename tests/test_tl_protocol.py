"""TransformerLens's inspect protocol (provider/tl_protocol.py): translation both ways and its errors.

Fast: no engine, no Ray, no transformer-lens (the answer is decoded the way TransformerLens's
`wire.decode_array` does: base64 of the raw bytes, numpy dtype name, shape).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
import pytest
from inspect_ai.model import GenerateConfig

from provider.tl_protocol import TLCall, requested
from replicas.api import AttentionInfo, Choice, GenerateRequest, GenerateResult, ModelInfo
from replicas.api.arrays import from_raw
from replicas.api.errors import InvalidRequestError
from tests.test_provider import D_MODEL, FakeApp

D = 8
INFO = ModelInfo(
    model="/m/tiny", architecture="LlamaForCausalLM", n_layers=2, d_model=D, d_vocab=11, max_model_len=64,
    dtype="float32", hook_names=[], armed_kinds=["resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"],
)


def config(**extra_args: Any) -> GenerateConfig:
    return GenerateConfig(temperature=0.0, max_tokens=1, extra_body={"extra_args": extra_args})


def translate(**extra_args: Any) -> dict[str, Any]:
    call = TLCall.parse(config(**extra_args))
    assert call is not None
    request = call.request([{"role": "user", "content": ""}], config(**extra_args), INFO)
    GenerateRequest.model_validate(request)  # what the replica will accept
    return request


def decode(entry: dict[str, Any]) -> np.ndarray:
    """TransformerLens's reading of an array entry (sources/inspect/wire.py decode_array)."""
    raw = base64.b64decode(entry["data"])
    return np.frombuffer(raw, dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])


def test_only_extra_args_selects_the_protocol():
    assert not requested(GenerateConfig()) and not requested(GenerateConfig(extra_body={"capture": ["0:resid_post"]}))
    assert requested(config()) and TLCall.parse(GenerateConfig(extra_body={"interventions": []})) is None


def test_capture_and_logits_become_prompt_rows_of_one_greedy_token():
    request = translate(input_ids=np.array([[5, 6, 7]]), capture=["1:resid_post", "0:resid_pre", "1:resid_post"])
    assert request == {
        "prompt": [5, 6, 7], "max_tokens": 1, "temperature": 0.0,
        "capture": {"hooks": ["1:resid_post", "0:resid_pre"], "positions": "prompt"},
        "logits": {"positions": "prompt"},
    }  # fmt: skip
    assert "logits" not in translate(input_ids=[5], return_logits=False)
    assert translate(capture=["0:mlp_out"])["prompt"] == [{"role": "user", "content": ""}]  # no ids: the messages


def test_every_op_maps_onto_capserves_vocabulary():
    ids = [1, 2, 3, 4]
    rows = np.arange(2 * D, dtype=np.float32).reshape(2, D)
    request = translate(input_ids=ids, interventions={
        "0:resid_post": {"op": "suppress"},
        "0:attn_out": {"op": "scale", "factor": 2, "pos": [0, -1]},
        "1:resid_pre": {"op": "add", "value": 0.5},
        "1:mlp_out": {"op": "add", "value": np.stack([rows[0], rows[1], rows[0]]), "pos": [1, 2, 3]},
        "1:attn_out": {"op": "set", "value": rows, "pos": [3, 0]},
    })  # fmt: skip
    edits = GenerateRequest.model_validate(request).interventions
    assert [(e.hook, e.op, e.positions) for e in edits] == [
        ("0:resid_post", "scale", "prompt"),
        ("0:attn_out", "scale", [0, 3]),
        ("1:resid_pre", "add", "prompt"),
        ("1:mlp_out", "add", [1, 3]),  # one edit per distinct row
        ("1:mlp_out", "add", [2]),
        ("1:attn_out", "set", [3, 0]),
    ]
    assert edits[0].factor == 0.0 and edits[1].factor == 2.0
    np.testing.assert_array_equal(edits[2].vector, np.full(D, 0.5, np.float32))
    np.testing.assert_array_equal(edits[3].vector, rows[0])
    np.testing.assert_array_equal(edits[4].vector, rows[1])
    np.testing.assert_array_equal(edits[5].values, rows)


def test_a_position_listed_twice_is_edited_once_as_transformerlens_indexes():
    """TransformerLens's provider does out[..., pos, :] = op(t[..., pos, :]): a repeated position is
    edited once, and a per-position value gives it its last row."""
    ids = [1, 2, 3, 4]
    rows = np.arange(3 * D, dtype=np.float32).reshape(3, D)
    request = translate(input_ids=ids, interventions={
        "0:resid_post": {"op": "suppress", "pos": [1, -3]},
        "1:mlp_out": {"op": "add", "value": rows, "pos": [2, 0, 2]},
        "1:attn_out": {"op": "set", "value": rows, "pos": [3, 3, 1]},
    })  # fmt: skip
    edits = GenerateRequest.model_validate(request).interventions
    assert [(e.hook, e.op, e.positions) for e in edits] == [
        ("0:resid_post", "scale", [1, 1]), ("1:mlp_out", "add", [2]), ("1:mlp_out", "add", [0]), ("1:attn_out", "set", [3, 3, 1]),
    ]
    np.testing.assert_array_equal(edits[1].vector, rows[2])  # position 2: the last of its two rows
    np.testing.assert_array_equal(edits[2].vector, rows[1])
    np.testing.assert_array_equal(edits[3].values, rows)  # the replica's set takes the last row for position 3


def test_a_number_on_an_attention_kind_covers_its_flat_heads_row():
    """TransformerLens's provider adds or sets a scalar value on the flat [pos, heads x d_head]
    tensor of v and z as on the residual stream, and scales them by a factor."""
    info = INFO.model_copy(update={"armed_kinds": [*INFO.armed_kinds, "v", "z"], "attention": AttentionInfo(
        n_heads=4, n_kv_heads=2, d_head=3, d_head_v=3, scale=[1.0] * 2, soft_cap=[0.0] * 2, sliding_window=[None] * 2)})
    args = {"input_ids": [1, 2, 3], "interventions": {
        "0:z": {"op": "add", "value": 0.5, "pos": [1]}, "1:v": {"op": "set", "value": -2.0}, "1:z": {"op": "scale", "factor": 3.0}}}
    request = TLCall.parse(config(**args)).request([], config(**args), info)
    edits = GenerateRequest.model_validate(request).interventions
    np.testing.assert_array_equal(edits[0].vector, np.full(4 * 3, 0.5, np.float32))
    np.testing.assert_array_equal(edits[1].values, np.full(2 * 3, -2.0, np.float32))
    assert (edits[2].op, edits[2].factor, edits[2].heads) == ("scale", 3.0, None)


def test_the_answer_is_the_protocols_wire_format():
    acts = np.arange(3 * D, dtype=np.float32).reshape(3, D)
    logits = np.linspace(-1, 1, 3 * 11, dtype=np.float32).reshape(3, 11)
    result = GenerateResult(
        request_id="r", text="x", token_ids=[9], prompt_token_ids=[5, 6, 7], finish_reason="length",
        choices=[Choice(text="x", token_ids=[9], finish_reason="length")], activations={"1:resid_post": acts},
        positions=[0, 1, 2], capture_token_ids=[5, 6, 7], logits=logits, logits_positions=[0, 1, 2], replica="r0",
    )  # fmt: skip
    meta = TLCall.parse(config(input_ids=[5, 6, 7], capture=["1:resid_post"])).metadata(result)
    assert set(meta["activations"]) == {"1:resid_post"}
    assert meta["activations"]["1:resid_post"]["dtype"] == "float32" and meta["activations"]["1:resid_post"]["shape"] == [3, D]
    np.testing.assert_array_equal(decode(meta["activations"]["1:resid_post"]), acts)
    np.testing.assert_array_equal(decode(meta["tl_logits"]), logits)
    np.testing.assert_array_equal(from_raw(meta["tl_logits"]), logits)
    assert meta["replica"] == "r0" and meta["activation_positions"] == [0, 1, 2]
    no_logits = TLCall.parse(config(input_ids=[5, 6, 7], return_logits=False)).metadata(result)
    assert "tl_logits" not in no_logits and no_logits["activations"] == {}


def test_patterns_go_out_in_transformerlens_axis_order():
    pattern = np.random.default_rng(0).random((3, 2, 3)).astype(np.float32)  # capserve: [q_pos, heads, k_pos]
    result = GenerateResult(
        request_id="r", text="x", token_ids=[9], prompt_token_ids=[5, 6, 7], finish_reason="length",
        choices=[Choice(text="x", token_ids=[9], finish_reason="length")], activations={"0:pattern": pattern},
        positions=[0, 1, 2], capture_token_ids=[5, 6, 7],
    )  # fmt: skip
    meta = TLCall.parse(config(input_ids=[5, 6, 7], capture=["0:pattern"], return_logits=False)).metadata(result)
    np.testing.assert_array_equal(decode(meta["activations"]["0:pattern"]), pattern.transpose(1, 0, 2))


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ({"input_id": [1]}, r"extra_args: unknown key\(s\) \['input_id'\]; allowed: input_ids, capture"),
        ({"input_ids": []}, r"extra_args\.input_ids: expected a non-empty list of token ids"),
        ({"input_ids": [[1, 2], [3, 4]]}, r"extra_args\.input_ids: .*batch size 1"),
        ({"input_ids": [1, -2]}, r"extra_args\.input_ids"),
        ({"input_ids": [1, 2], "attention_mask": [0, 1]}, r"extra_args\.attention_mask: capserve runs one unpadded sequence"),
        ({"return_logits": "yes"}, r"extra_args\.return_logits: expected true or false"),
        ({"capture": "1:resid_post"}, r"extra_args\.capture: expected a list of wire keys"),
        ({"capture": ["blocks.1.hook_out"]}, r"extra_args\.capture\[0\]: 'blocks\.1\.hook_out' is not a wire key; use '<layer>:<kind>'"),
        ({"capture": ["1:q"]}, r"extra_args\.capture\[0\]: '1:q': capserve's q is taken after rotary"),
        ({"capture": ["1:resid_later"]}, r"extra_args\.capture\[0\]: unknown kind 'resid_later'.*kinds: resid_pre"),
        ({"interventions": [{"op": "add"}]}, r"extra_args\.interventions: expected a mapping of wire key to spec"),
        ({"interventions": {"1:resid_post": {"op": "zero"}}}, r"interventions\['1:resid_post'\]: op 'zero' is not one of suppress, scale, add, set"),
        ({"interventions": {"1:resid_post": lambda x: x}}, r"interventions\['1:resid_post'\]: op .* is not one of"),
        ({"interventions": {"1:resid_post": {"op": "scale"}}}, r"interventions\['1:resid_post'\]\.factor: op 'scale' needs a finite number"),
        ({"interventions": {"1:resid_post": {"op": "scale", "factor": float("nan")}}}, r"\.factor: op 'scale' needs a finite number"),
        ({"interventions": {"1:resid_post": {"op": "add"}}}, r"\.value: op 'add' needs a value"),
        ({"interventions": {"1:resid_post": {"op": "add", "value": [1.0, float("inf")]}}}, r"\.value: NaN or infinite"),
        ({"interventions": {"1:resid_post": {"op": "add", "value": 1.0, "scale": 2}}}, r"key\(s\) \['scale'\] do not apply to op 'add'; it takes op, value, pos"),
        ({"interventions": {"1:resid_post": {"op": "suppress", "pos": "last"}}}, r"\.pos: expected an int or a non-empty list of ints"),
        ({"input_ids": [1, 2], "interventions": {"1:resid_post": {"op": "suppress", "pos": [0, 2]}}}, r"\.pos: position\(s\) \[2\] outside the 2 input tokens \(allowed -2\.\.1\)"),
        ({"input_ids": [1, 2], "interventions": {"1:resid_post": {"op": "set", "value": np.zeros((3, D))}}}, r"\.value: 3 rows for 2 position\(s\)"),
        ({"interventions": {"1:resid_post": {"op": "add", "value": np.zeros((2, D))}}}, r"\.value: a per-position value needs pos or input_ids"),
    ],
)
def test_bad_extra_args_name_the_field_and_what_is_allowed(extra_args, message):
    with pytest.raises(InvalidRequestError, match=message):
        translate(**extra_args)


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ({"capture": ["2:resid_post"]}, r"extra_args\.capture\[0\]: layer 2 out of range; the model has layers 0\.\.1"),
        ({"capture": ["0:z"]}, r"extra_args\.capture\[0\]: kind 'z' is not served by this deployment; served: \['attn_out'"),
        ({"interventions": {"1:resid_post": {"op": "add", "value": [1.0, 2.0]}}}, r"interventions\['1:resid_post'\]\.value: width 2, the model's d_model is 8"),
    ],
)
def test_what_the_served_model_cannot_do_is_refused_before_the_replica(extra_args, message):
    with pytest.raises(InvalidRequestError, match=message):
        translate(**extra_args)


def test_no_other_extra_body_key_rides_with_extra_args():
    with pytest.raises(InvalidRequestError, match=r"extra_body: with extra_args .* remove \['capture'\]"):
        TLCall.parse(GenerateConfig(extra_body={"extra_args": {}, "capture": ["0:resid_post"]}))


def test_the_provider_answers_the_protocol_and_sends_nothing_bad_to_the_app():
    from inspect_ai.model import get_model

    import provider._registry  # noqa: F401

    class ArmedApp(FakeApp):
        async def _info(self) -> ModelInfo:
            return (await super()._info()).model_copy(update={"armed_kinds": ["resid_pre", "resid_post"]})

    app = ArmedApp(n_positions=3)
    model = get_model("capserve/fake", handle=app, memoize=False)
    output = asyncio.run(model.generate("", config=config(input_ids=[1, 2, 3], capture=["0:resid_post"])))
    assert app.requests[-1]["prompt"] == [1, 2, 3] and app.requests[-1]["max_tokens"] == 1
    assert decode(output.metadata["activations"]["0:resid_post"]).shape == (3, D_MODEL)
    assert decode(output.metadata["tl_logits"]).shape == (1, 16)  # the fake's logits
    sent = len(app.requests)
    with pytest.raises(InvalidRequestError, match=r"extra_args\.capture\[0\]"):
        asyncio.run(model.generate("", config=config(input_ids=[1], capture=["x"])))
    assert len(app.requests) == sent
