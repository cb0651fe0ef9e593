"""CapRL drop-in: `/get_reward` against real `rl-rewards serve` processes whose judges are tiny
checkpoints of `rl_models.tiny` loaded through from_pretrained — qa on the video task (format
reward added) and on the image task (none), and vl_judge on videos under a `--media-root`.
The three servers start together (importing torch dominates; two cores overlap it).
Needs rl-rewards[hf] (torch); the no-torch paths are in test_server_http.py."""

from __future__ import annotations

import contextlib
from pathlib import Path

import httpx
import pytest
from conftest import assert_healthy, server_process

from rl_rewards.rules import timestamp_format

torch = pytest.importorskip("torch")
tiny = pytest.importorskip("rl_models.tiny")
pytest.importorskip("rl_rewards.scorers.caption_qa")
pytest.importorskip("rl_rewards.scorers.vl_judge")
from transformers import AutoModelForImageTextToText, AutoProcessor  # noqa: E402

from rl_rewards.registry import build_scorer  # noqa: E402
from rl_rewards.samples import Sample  # noqa: E402

QUESTION = "What colour is the circle?\n   - A) red\n   - B) blue\n   - C) green"
QA = [[QUESTION, "A"], ["Is it moving?\n   - A) yes\n   - B) no", "B"]]
CAPTIONS = ["[00:01] a red circle [00:04] it fades", "[00:09] a dog [00:02] runs", "no stamps at all"]
QA_OPTIONS = {"estimator": "exact", "engine_options": {"device": "cpu"}}
QA_ARGS = ["--judge-option", "estimator=exact", "--judge-option", 'engine_options={"device": "cpu"}']
VL_OPTIONS = {"engine_options": {"device": "cpu"}, "max_frames": 4, "max_new_tokens": 32}
VL_ARGS = [
    "--judge-option", 'engine_options={"device": "cpu"}', "--judge-option", "max_frames=4",
    "--judge-option", "max_new_tokens=32",
]
VIDEOS = Path(__file__).resolve().parents[4] / "examples" / "data" / "videos"

# The scripted judge's whole answer, token by token (each token once: see build_scripted_judge).
ANSWER = ['{"', "factuality", '":', "1", ",", ' "', "coverage", '"', ":", "0", ".", "5", "}"]
ANSWER_SCORE = 0.30 * 1 + 0.25 * 0.5  # factuality 1, coverage 0.5; the two missing criteria count 0
MARKER = " red"


def build_scripted_judge(out: Path) -> Path:
    """The tiny random Qwen2.5-VL with its text tower rewired so that greedy decoding writes
    `ANSWER` when the caption says " red" often and stops at once otherwise (the vision tower
    stays random). Random weights never write JSON, so every reward would be CapRL's 0 and a
    server-vs-in-process comparison could not fail; this judge gives 0.425 or 0 by caption.

    How: residual dimension k stands for the k-th token of [end of prompt, *ANSWER]; lm_head maps
    it to the next token, the last one to <|im_end|> (a bigram table: every MLP and attention
    output is zeroed, so the current token alone decides). Layer 0 keeps one head with zero
    queries — uniform attention over the context — that writes 5 x 8 x (share of " red" tokens)
    into a flag dimension (8: the RMSNorm gain of a one-hot row in 64 dims). At the end of the
    prompt the flag's 10 x flag beats <|im_end|>'s 2.5 once the share passes 1/160: three or more
    " red" in the ~320-token video prompt (the test captions have none or five to six)."""
    source = tiny.build("qwen2_5_vl")
    model = AutoModelForImageTextToText.from_pretrained(source)
    processor = AutoProcessor.from_pretrained(source)
    tokenizer = processor.tokenizer
    ids = {tokenizer.decode([i]): i for i in range(len(tokenizer))}
    answer = [ids[t] for t in ANSWER]
    assert len(set(answer)) == len(answer), "a repeated token would loop: the table has one successor per token"
    prompt_end = tokenizer.encode("<|im_start|>assistant\n")[-1]  # the generation prompt's last token
    path = [prompt_end, *answer, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    marker, flag = len(path) - 1, len(path)  # residual dims after the bigram states
    text = model.model.language_model
    merger_out = model.model.visual.merger.mlp[2]
    with torch.no_grad():
        text.embed_tokens.weight.zero_()  # [V, 64]
        model.lm_head.weight.zero_()  # [V, 64]
        for state, token in enumerate(path[1:-1], start=1):
            text.embed_tokens.weight[token, state] = 1.0
            model.lm_head.weight[path[state + 1], state] = 50.0
        text.embed_tokens.weight[path[0], 0] = 1.0
        model.lm_head.weight[path[-1], 0] = 2.5  # after the prompt: stop ...
        model.lm_head.weight[path[1], flag] = 10.0  # ... unless the " red" flag is up
        text.embed_tokens.weight[ids[MARKER], marker] = 1.0
        for layer in text.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        attention = text.layers[0].self_attn
        for weight in (attention.q_proj.weight, attention.q_proj.bias, attention.v_proj.weight, attention.v_proj.bias):
            weight.zero_()
        attention.v_proj.weight[0, marker] = 1.0  # head 0 averages the marker dimension ...
        attention.o_proj.weight[flag, 0] = 5.0  # ... into the flag
        merger_out.weight[marker].zero_()  # vision tokens never look like " red"
        merger_out.bias[marker] = 0.0
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def qa_judge():
    return str(tiny.build("qwen3"))


@pytest.fixture(scope="module")
def vl_judge(tmp_path_factory):
    return str(build_scripted_judge(tmp_path_factory.mktemp("scripted-judge")))


@pytest.fixture(scope="module")
def server_logs(tmp_path_factory):
    """The folder of the servers' logs (`NAME.log`)."""
    return tmp_path_factory.mktemp("caprl")


@pytest.fixture(scope="module")
def servers(request, server_logs, qa_judge):
    """Three servers, started together: qa/video, qa/image, vl_judge (media root: VIDEOS)."""
    tmp = server_logs
    qa_env = {"REWARD_MODEL": qa_judge, "REWARD_QA_NUM": "4", "FORMAT_REWARD_WEIGHT": "0.2"}
    procs = {
        "video": server_process(tmp, "video", QA_ARGS, {**qa_env, "REWARD_TASK": "video"}, ready_timeout=300),
        "image": server_process(tmp, "image", QA_ARGS, {**qa_env, "REWARD_TASK": "image"}, ready_timeout=300),
    }
    with contextlib.ExitStack() as stack:
        for proc in procs.values():
            stack.callback(proc.stop)
            proc.start(wait=False)
        vl_env = {"REWARD_MODEL": request.getfixturevalue("vl_judge"), "REWARD_SCORE_MODE": "vl_judge"}
        vl_args = [*VL_ARGS, "--media-root", str(VIDEOS)]
        procs["vl_judge"] = server_process(tmp, "vl_judge", vl_args, vl_env, ready_timeout=300)
        stack.callback(procs["vl_judge"].stop)
        procs["vl_judge"].start(wait=False)
        for proc in procs.values():
            proc.wait_ready()
        yield {name: proc.url for name, proc in procs.items()}


def qa_expected(judge: str, task: str, captions: list[str]) -> list[float]:
    scorer = build_scorer("caption_qa", model=judge, task=task, **QA_OPTIONS)
    return [r.score for r in scorer.score([Sample(completion=c, reference=QA) for c in captions])]


def get_reward(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/get_reward", json=body, timeout=120)


def test_qa_video_request_matches_in_process_scorer(servers, qa_judge):
    body = {"prompts": [[c, QA] for c in CAPTIONS], "query": [], "labels": []}
    r = get_reward(servers["video"], body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"rewards", "qa_rewards", "format_rewards"}
    assert out["format_rewards"] == [timestamp_format(c) for c in CAPTIONS]
    expected = qa_expected(qa_judge, "video", CAPTIONS)
    assert out["qa_rewards"] == pytest.approx(expected, abs=1e-5)
    assert out["rewards"] == pytest.approx([q + 0.2 * f for q, f in zip(expected, out["format_rewards"], strict=True)], abs=1e-5)


def test_qa_image_task_has_no_format_reward_and_uses_the_image_prompt(servers, qa_judge):
    body = {"prompts": [[c, QA] for c in CAPTIONS], "query": [], "labels": []}
    r = get_reward(servers["image"], body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"rewards", "qa_rewards"}  # timestamps in the captions earn nothing here
    expected = qa_expected(qa_judge, "image", CAPTIONS)
    assert out["qa_rewards"] == pytest.approx(expected, abs=1e-5)
    assert out["rewards"] == out["qa_rewards"]
    video = get_reward(servers["video"], body).json()["qa_rewards"]
    assert max(abs(a - b) for a, b in zip(out["qa_rewards"], video, strict=True)) > 1e-4  # other prompt


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine auto may pick vLLM")
def test_judge_engine_auto_picks_hf_here_says_why_in_the_log_and_in_health(servers, server_logs, qa_judge):
    """No REWARD_ENGINE: `auto`, resolved once by the server process, logged with its reason."""
    health = httpx.get(f"{servers['video']}/health", timeout=5).json()
    assert health["judge"] == "caption_qa" and health["judge_engine"] == "hf"
    log = (server_logs / "video.log").read_text()
    assert f"caption_qa judge {qa_judge}: engine hf (auto: no CUDA device, vLLM needs one)" in log


def test_bad_sample_is_its_own_error(servers):
    body = {"prompts": [["[00:01] ok", [[QUESTION, "A"]]], ["[00:01] empty", []], ["[00:02] x", [[QUESTION, "A"]]]]}
    out = get_reward(servers["video"], body).json()
    assert out["errors"][0] is None and out["errors"][2] is None
    assert "empty QA list" in out["errors"][1]
    assert out["rewards"][1] == 0.0 and 0.0 <= out["qa_rewards"][0] <= 1.0
    assert out["rewards"][0] == pytest.approx(out["qa_rewards"][0] + 0.2 * 1.0, abs=1e-6)
    assert_healthy(servers["video"])


VL_SAMPLES = [
    ("[00:00] a red ball, red on red, then red and red again", "clip_00.mp4"),
    ("[00:00] a blue square slides left", "clip_01.mp4"),
    ("[00:02] red red red red red red", str(VIDEOS / "clip_02.mp4")),  # absolute, inside the root
    ("[00:00] red red red red red red", "../clip_00.mp4"),  # outside the root
    ("[00:00] red red red red red red", "missing.mp4"),  # inside the root, no such file
    ("[00:01] a blue square, red red red red red red", "clip_01.mp4"),
]


def test_vl_judge_request_matches_in_process_scorer(servers, vl_judge):
    body = {"score_mode": "vl_judge", "samples": [{"caption": c, "video_path": v} for c, v in VL_SAMPLES]}
    r = get_reward(servers["vl_judge"], body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"rewards", "judge_rewards", "errors"}
    assert len(out["rewards"]) == len(out["judge_rewards"]) == len(out["errors"]) == len(VL_SAMPLES)
    assert out["rewards"] == out["judge_rewards"]
    errors = out["errors"]
    assert "outside the media roots" in errors[3] and "metadata.video" in errors[3]
    assert "missing.mp4" in errors[4]
    assert [e is None for e in errors] == [True, True, True, False, False, True]
    assert out["rewards"][3] == out["rewards"][4] == 0.0
    scorer = build_scorer("vl_judge", model=vl_judge, **VL_OPTIONS)
    scored = [0, 1, 2, 5]
    samples = [Sample(completion=VL_SAMPLES[i][0], metadata={"video": str(VIDEOS / VL_SAMPLES[i][1])}) for i in scored]
    expected = [res.score for res in scorer.score(samples)]
    assert [out["rewards"][i] for i in scored] == expected
    assert expected == [ANSWER_SCORE, 0.0, ANSWER_SCORE, ANSWER_SCORE]  # so the comparison can fail
    # the server's REWARD_SCORE_MODE applies when a request names none
    r = get_reward(servers["vl_judge"], {"samples": body["samples"][:2]})
    assert r.json()["rewards"] == [ANSWER_SCORE, 0.0]
    assert_healthy(servers["vl_judge"])


def test_request_for_the_other_score_mode_is_a_clear_422(servers):
    qa = {"score_mode": "qa", "prompts": [[CAPTIONS[0], QA]], "query": [], "labels": []}
    r = get_reward(servers["vl_judge"], qa)
    assert r.status_code == 422
    assert "no judge configured" in r.json()["error"] and r.json()["field"] == "$.score_mode"
    judge = {"score_mode": "vl_judge", "samples": [{"caption": "c", "video_path": "clip_00.mp4"}]}
    r = get_reward(servers["video"], judge)
    assert r.status_code == 422
    assert "no vl_judge configured" in r.json()["error"] and r.json()["field"] == "$.score_mode"
    assert_healthy(servers["vl_judge"])
    assert_healthy(servers["video"])


def test_caprl_request_without_score_mode_is_read_by_its_shape(servers):
    """CapRL's qa request names no score_mode: sent to a vl_judge server it is a qa request all
    the same (its `prompts` say so) and gets the 422 that names the fix, not 200 with no rewards."""
    r = get_reward(servers["vl_judge"], {"prompts": [[c, QA] for c in CAPTIONS], "query": [], "labels": []})
    assert r.status_code == 422, f"{r.status_code} {r.text}"
    assert "no judge configured" in r.json()["error"] and r.json()["field"] == "$.score_mode"


def test_vl_judge_empty_video_path_is_judged_on_the_caption_alone(servers, vl_judge):
    # CapRL++'s client sends video_path="" for a sample without a video: no media, not an error
    captions = ["[00:00] red red red red red red", "[00:00] a blue square slides left"]
    body = {"score_mode": "vl_judge", "samples": [{"caption": c, "video_path": ""} for c in captions]}
    r = get_reward(servers["vl_judge"], body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert "errors" not in out
    scorer = build_scorer("vl_judge", model=vl_judge, **VL_OPTIONS)
    expected = [res.score for res in scorer.score([Sample(completion=c) for c in captions])]
    assert out["rewards"] == expected == [ANSWER_SCORE, 0.0]  # the scripted judge read the caption
