# ruff: noqa: E402  (imports follow the importorskip of the optional extra)
"""clip_score / aesthetic on the tiny random CLIP from rl_models.tiny (real from_pretrained)."""

import pytest

torch = pytest.importorskip("torch")  # the [vision] extra; skipped in the torch-free session

from PIL import Image

from rl_rewards.registry import build_scorer
from rl_rewards.samples import Sample
from rl_rewards.scorers.vision import laion_head


@pytest.fixture(scope="module")
def clip_path():
    from rl_models.tiny import build

    return str(build("clip"))


def _images(tmp_path):
    paths = []
    for i, color in enumerate(["red", "navy", "white"]):
        path = tmp_path / f"{i}.png"
        Image.new("RGB", (48, 40), color).save(path)
        paths.append(str(path))
    return paths


def test_clip_score_is_clipped_weighted_cosine(clip_path, tmp_path):
    scorer = build_scorer("clip_score", model=clip_path)
    paths = _images(tmp_path)
    prompts = ["a red square", "a blue square", "white"]
    samples = [Sample(prompt=p, completion="", metadata={"image": path}) for p, path in zip(prompts, paths, strict=True)]
    samples.append(Sample(prompt="x", completion="", metadata={}))
    results = scorer.score(samples)
    assert results[3].error is not None and "no image" in results[3].error
    # by hand through CLIPModel.forward: logits_per_image = exp(logit_scale) * cos
    images = [Image.open(p).convert("RGB") for p in paths]
    enc = scorer.processor(text=prompts, images=images, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = scorer.clip(**enc)
    cos = out.logits_per_image.diagonal() / scorer.clip.logit_scale.exp()
    assert [r.score for r in results[:3]] == pytest.approx((2.5 * cos.clamp(min=0)).tolist(), abs=1e-5)


def test_aesthetic_with_and_without_a_head_file(clip_path, tmp_path):
    paths = _images(tmp_path)
    samples = [Sample(completion="", metadata={"image": p}) for p in paths]
    random_head = build_scorer("aesthetic", model=clip_path, seed=3).score(samples)
    head = laion_head(32)
    with torch.no_grad():
        for p in head.parameters():
            p.fill_(0.01)
    torch.save(head.state_dict(), tmp_path / "head.pth")
    scorer = build_scorer("aesthetic", model=clip_path, head=str(tmp_path / "head.pth"))
    loaded = scorer.score(samples)
    # the saved head applied by hand (eval mode: dropout off) to the scorer's normalized embeddings
    head.eval()
    emb = scorer.image_embeddings([Image.open(p).convert("RGB") for p in paths])
    assert [r.score for r in loaded] == pytest.approx(head(emb).squeeze(-1).tolist(), abs=1e-6)
    assert [r.score for r in loaded] != pytest.approx([r.score for r in random_head])
    assert set(head.state_dict()) >= {"layers.0.weight", "layers.7.bias"}  # LAION's key names
