"""embedding_similarity on the tiny BGE-style encoder from rl_models.tiny."""

import pytest

from rl_rewards.registry import build_scorer
from rl_rewards.rules import embedding_similarity_map
from rl_rewards.samples import Sample


@pytest.fixture(scope="module")
def encoder_path():
    from rl_models.tiny import build

    return str(build("embedding"))


def test_identical_text_scores_one_and_components_report_cosine(encoder_path):
    scorer = build_scorer("embedding_similarity", model=encoder_path)
    results = scorer.score([
        Sample(completion="the cat sat on the mat", reference="the cat sat on the mat"),
        Sample(completion="quantum chromodynamics", reference="the cat sat on the mat"),
        Sample(completion="no reference"),
    ])
    assert results[0].components["cosine"] == pytest.approx(1.0, abs=1e-5)
    assert results[0].score == 1.0
    s = results[1].components["cosine"]
    assert results[1].score == pytest.approx(embedding_similarity_map(s))
    assert results[2].error is not None and "reference text" in results[2].error


def test_verl_with_rms_affine_and_mean_pooling(encoder_path):
    scorer = build_scorer("embedding_similarity", model=encoder_path, pooling="mean", scale=0.7, offset=0.3)
    [result] = scorer.score([Sample(completion="a b c", reference="a b c")])
    assert result.score == pytest.approx(0.7 * 1.0 + 0.3)
    with pytest.raises(ValueError, match="pooling"):
        build_scorer("embedding_similarity", model=encoder_path, pooling="max")


def test_verl_with_rms_response_fields_and_malformed_json_scores_zero(encoder_path):
    scorer = build_scorer("embedding_similarity", model=encoder_path, scale=0.7, offset=0.3,
                          completion_field="Response", reference_field="Response")
    target = '{"Response": "the cat sat on the mat", "Solution": "none"}'
    results = scorer.score([
        Sample(completion='{"Response": "the cat sat on the mat", "Solution": "other"}', reference=target),
        Sample(completion="not json at all", reference=target),
        Sample(completion='{"Response": "x"}', reference="not json"),
    ])
    assert results[0].score == pytest.approx(0.7 * 1.0 + 0.3)  # the fields match, the rest differs
    assert results[0].components == {"cosine": pytest.approx(1.0, abs=1e-5), "malformed": 0.0}
    assert [r.score for r in results[1:]] == [0.0, 0.0]  # VeRL-with-RMs: 0.0, not the 0.3 offset
    assert [r.components["malformed"] for r in results[1:]] == [1.0, 1.0]
