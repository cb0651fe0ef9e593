"""The wire schema: CapRL shapes exactly, omitted optional fields, error paths, schema evolution."""

from __future__ import annotations

import json

import msgspec
import pytest

from rl_rewards import wire
from rl_rewards.samples import Sample, ScoreResult

pytestmark = pytest.mark.no_torch

CAPRL_QA = {
    "prompts": [["A red circle on white.", [["What colour is the circle?\n   - A) red\n   - B) blue", "A"]]]],
    "query": [],
    "labels": [],
}


def test_caprl_qa_request_decodes_exactly():
    req = wire.decode_json(json.dumps(CAPRL_QA).encode(), wire.GetRewardRequest)
    caption, qa = req.prompts[0]
    assert caption == "A red circle on white."
    assert qa == [("What colour is the circle?\n   - A) red\n   - B) blue", "A")]
    assert req.score_mode is None and req.samples == []


def test_vl_judge_request_decodes():
    body = {"score_mode": "vl_judge", "samples": [{"caption": "c", "video_path": "v/1.mp4"}]}
    req = wire.decode_json(json.dumps(body).encode(), wire.GetRewardRequest)
    assert req.score_mode == "vl_judge"
    assert req.samples == [wire.VLJudgeSample(caption="c", video_path="v/1.mp4")]


def test_caprl_responses_omit_fields_not_computed():
    assert json.loads(wire.encode_json(wire.GetRewardResponse(rewards=[]))) == {"rewards": []}
    qa = wire.GetRewardResponse(rewards=[1.2], qa_rewards=[1.0], format_rewards=[1.0])
    assert json.loads(wire.encode_json(qa)) == {"rewards": [1.2], "qa_rewards": [1.0], "format_rewards": [1.0]}
    judge = wire.GetRewardResponse(rewards=[0.5], judge_rewards=[0.5])
    assert json.loads(wire.encode_json(judge)) == {"rewards": [0.5], "judge_rewards": [0.5]}


def test_openrlhf_shapes():
    req = wire.decode_json(b'{"query": ["pq"], "prompts": ["p"], "labels": ["l"]}', wire.OpenRLHFRequest)
    assert (req.query, req.prompts, req.labels) == (["pq"], ["p"], ["l"])
    resp = wire.OpenRLHFResponse(rewards=[1.0], scores=[1.0], extra_logs={"format": [1.0]})
    assert json.loads(wire.encode_json(resp)) == {"rewards": [1.0], "scores": [1.0], "extra_logs": {"format": [1.0]}}


def test_native_request_carries_samples_and_results():
    body = {"samples": [{"completion": "c", "metadata": {"image": "a.png"}}], "reward": "ocr"}
    req = wire.decode_json(json.dumps(body).encode(), wire.ScoreRequest)
    assert req.samples == [Sample(completion="c", metadata={"image": "a.png"})]
    out = wire.ScoreResponse(reward="ocr", results=[ScoreResult(score=None, error="boom")])
    assert json.loads(wire.encode_json(out))["results"][0] == {"score": None, "components": {}, "error": "boom"}


@pytest.mark.parametrize(
    ("body", "path"),
    [
        (b'{"prompts": [["c", [["q", 3]]]]}', "$.prompts[0][1][0][1]"),
        (b'{"prompts": [["c"]]}', "$.prompts[0]"),
        (b'{"score_mode": "x"}', "$.score_mode"),
        (b"[]", "$"),
    ],
)
def test_validation_errors_name_the_field(body, path):
    with pytest.raises(msgspec.ValidationError) as info:
        wire.decode_json(body, wire.GetRewardRequest)
    assert wire.validation_path(info.value) == path


def test_worker_messages_are_a_tagged_union():
    chunk = wire.ScoreChunk(id=3, reward="length", samples=[Sample(completion="x")])
    for message in (chunk, wire.Ping(id=4)):
        assert wire.decode_msgpack(wire.encode_msgpack(message), wire.WorkRequest) == message
    assert msgspec.msgpack.decode(wire.encode_msgpack(wire.Ping(id=1)))["type"] == "ping"


def test_old_messages_decode_after_new_fields():
    # a client built before `score_mode`/`samples` existed sends only prompts/query/labels,
    # and an old health probe reads only `ready`
    req = wire.decode_json(b'{"prompts": [], "query": [], "labels": []}', wire.GetRewardRequest)
    assert req.score_mode is None
    health = wire.decode_json(b'{"ready": true}', wire.HealthResponse)
    assert health.ready and health.rewards == []


def test_one_decoder_per_type():
    wire.decode_json(b'{"query": []}', wire.OpenRLHFRequest)
    first = wire._JSON_DECODERS[wire.OpenRLHFRequest]
    wire.decode_json(b'{"query": []}', wire.OpenRLHFRequest)
    assert wire._JSON_DECODERS[wire.OpenRLHFRequest] is first
