"""Settings precedence: defaults < TOML < CapRL env vars < flags; GPU groups per worker;
CapRL's REWARD_WORKER_BASE accepted by a real server, which says it ignores it."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import server_process

from rl_rewards.server.command import ignored_settings
from rl_rewards.server.settings import env_overrides, load_settings

pytestmark = pytest.mark.no_torch

CAPRL_ENV = {
    "REWARD_MODEL": "/models/qwen3-4b", "REWARD_PORT": "18889", "REWARD_WORKER_BASE": "18899",
    "REWARD_NUM_WORKERS": "2", "REWARD_SCORE_MODE": "qa", "REWARD_TASK": "image",
    "REWARD_QA_NUM": "4", "FORMAT_REWARD_WEIGHT": "0.3", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}


def test_defaults_bind_loopback_on_caprls_port():
    s = load_settings(environ={})
    assert (s.host, s.port, s.score_mode, s.task, s.qa_num, s.format_reward_weight) == ("127.0.0.1", 18889, "qa", "video", 8, 0.2)
    assert s.api_key is None and s.model is None and s.workers == 0


def test_caprl_environment_variables():
    s = load_settings(environ=CAPRL_ENV)
    assert s.model == "/models/qwen3-4b" and s.workers == 2 and s.worker_base_port == 18899
    assert (s.task, s.qa_num, s.format_reward_weight) == ("image", 4, 0.3)
    assert s.gpu_groups() == ["0,1", "2,3"]


def test_precedence_toml_env_flags(tmp_path):
    config = tmp_path / "s.toml"
    config.write_text('port = 1000\nqa_num = 2\ntask = "image"\n[limits]\nmax_text_chars = 10\n')
    s = load_settings(config, flags={"qa_num": 16, "port": None, "limits": {"max_body_bytes": 99}},
                      environ={"REWARD_PORT": "2000"})
    assert s.port == 2000  # env over TOML
    assert s.qa_num == 16  # flag over TOML
    assert s.task == "image"  # TOML over default
    assert (s.limits.max_text_chars, s.limits.max_body_bytes) == (10, 99)  # nested tables merge


def test_bad_values_name_the_source():
    with pytest.raises(ValueError, match="REWARD_PORT='abc'"):
        env_overrides({"REWARD_PORT": "abc"})
    with pytest.raises(ValueError, match=r"score_mode"):
        load_settings(environ={"REWARD_SCORE_MODE": "judge"})


def test_too_few_gpus_for_workers():
    s = load_settings(environ={"REWARD_NUM_WORKERS": "3", "CUDA_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match="at most 2 workers"):
        s.gpu_groups()
    assert load_settings(environ={"REWARD_NUM_WORKERS": "2"}).gpu_groups() == [None, None]


def test_reward_worker_base_is_accepted_and_the_log_says_it_is_ignored(tmp_path):
    assert ignored_settings(load_settings(environ={})) == []  # nothing to say without it
    env = {"REWARD_WORKER_BASE": "18899", "REWARD_NUM_WORKERS": "1"}
    with server_process(tmp_path, "worker_base", ["--log-format", "json"], env=env) as server:
        health = httpx.get(f"{server.url}/health", timeout=5).json()
        assert health["ready"] is True and health["workers_alive"] == 1
        r = httpx.post(f"{server.url}/v1/score", json={"samples": [{"completion": "[00:01] a"}]}, timeout=30)
        assert r.status_code == 200 and r.json()["results"][0]["score"] == 1.0
    log = [json.loads(line) for line in (tmp_path / "worker_base.log").read_text().splitlines() if line.startswith("{")]
    notes = [e["message"] for e in log if e["level"] == "warning" and "REWARD_WORKER_BASE" in e["message"]]
    assert len(notes) == 1
    assert notes[0].startswith("REWARD_WORKER_BASE=18899 is not needed and is ignored")
    assert "pipes, not ports" in notes[0]
    assert not any(e["level"] == "error" for e in log)


def test_caprl_plus_plus_fidelity_variables(tmp_path):
    env = {
        "FORMAT_REWARD_VARIANT": "caprl-server", "FORMAT_MIN_BRACKETS": "4", "REWARD_ANSWER_PARSER": "caprl",
        "REWARD_QA_PROMPT_FILE": "/prompts/caprl.txt", "REWARD_MEDIA_ROOT": f"{tmp_path}/a:{tmp_path}/b",
    }
    s = load_settings(environ=env)
    assert (s.format_reward_variant, s.format_min_brackets, s.answer_parser) == ("caprl-server", 4, "caprl")
    assert s.qa_prompt_file == "/prompts/caprl.txt"
    assert s.media_roots == [f"{tmp_path}/a", f"{tmp_path}/b"]
    defaults = load_settings(environ={})
    assert (defaults.format_reward_variant, defaults.format_min_brackets, defaults.answer_parser) == ("readme", 3, "strict")
    with pytest.raises(ValueError, match="format_reward_variant"):
        load_settings(environ={"FORMAT_REWARD_VARIANT": "server"})
    with pytest.raises(ValueError, match="answer_parser"):
        load_settings(environ={"REWARD_ANSWER_PARSER": "loose"})


def test_served_format_reward_follows_the_variant_settings():
    from rl_rewards.samples import Sample
    from rl_rewards.server.rewards import build_served, score_with

    sample = [Sample(completion="[00:01] x")]
    readme = build_served(load_settings(environ={}))
    server = build_served(load_settings(environ={"FORMAT_REWARD_VARIANT": "caprl-server"}))
    wide = build_served(load_settings(environ={"FORMAT_REWARD_VARIANT": "caprl-server", "FORMAT_MIN_BRACKETS": "1"}))
    assert score_with(readme, "timestamp_format", sample)[0].score == 1.0
    assert score_with(server, "timestamp_format", sample)[0].score == pytest.approx(0.70)
    assert score_with(wide, "timestamp_format", sample)[0].score == 1.0


def test_no_media_root_is_said_at_start():
    (note,) = load_settings(environ={}).notes()
    assert "no media root configured" in note and "REWARD_MEDIA_ROOT" in note
    assert load_settings(environ={"REWARD_MEDIA_ROOT": "/data"}).notes() == []


def test_server_without_media_root_says_so_and_refuses_media_per_sample(tmp_path):
    with server_process(tmp_path, "no_media", ["--log-format", "json"]) as server:
        samples = [{"completion": "[00:01] a", "metadata": {"image": "cat.png"}}, {"completion": "[00:01] b"}]
        r = httpx.post(f"{server.url}/v1/score", json={"samples": samples}, timeout=30)
        results = r.json()["results"]
        assert "refused: the server has no --media-root" in results[0]["error"]
        assert results[1]["score"] == 1.0 and results[1].get("error") is None
    log = [json.loads(line) for line in (tmp_path / "no_media.log").read_text().splitlines() if line.startswith("{")]
    notes = [e["message"] for e in log if "no media root configured" in e["message"]]
    assert len(notes) == 1 and "REWARD_MEDIA_ROOT" in notes[0]
    (tmp_path / "media").mkdir()
    with server_process(tmp_path, "media", ["--log-format", "json"], env={"REWARD_MEDIA_ROOT": str(tmp_path / "media")}):
        pass
    assert "no media root configured" not in (tmp_path / "media.log").read_text()


NON_FINITE = {  # field: (TOML line, the value as the error prints it)
    "weight": ("weight = inf", "inf"),
    "fallback": ("fallback = -inf", "-inf"),
    "gate.threshold": ('gate = { component = "format", threshold = nan }', "nan"),
}


@pytest.mark.parametrize(("workers", "field"), [
    ([], "weight"), (["--workers", "2"], "weight"), (["--workers", "2"], "fallback"), ([], "gate.threshold"),
])
def test_a_non_finite_number_in_a_reward_spec_stops_serve_with_one_line(tmp_path, workers, field):
    """`weight = inf` (or nan) reached the workers as JSON null: every worker failed validation
    and `--workers 2` died at start, while one process served it (every sample failed). Now both
    refuse the file at start: exit 2, one line naming the file, the reward, the component and the
    field."""
    import subprocess
    import sys

    from rl_rewards.server.process import free_port

    config = tmp_path / "server.toml"
    config.write_text(
        '[rewards.caption.components.format]\nscorer = "timestamp_format"\n'
        '[rewards.caption.components.length]\nscorer = "length"\noptions = { tokenizer = "whitespace" }\n'
        f"{NON_FINITE[field][0]}\n"
    )
    cmd = [sys.executable, "-m", "rl_rewards.cli", "serve", "--config", str(config), "--port", str(free_port()),
           *workers]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    value = NON_FINITE[field][1]
    assert lines[0] == (f"rl-rewards serve: error: {config} [rewards.caption]: components.length.{field} = {value} "
                        "is not a finite number; set a finite value")


def test_a_non_finite_server_setting_is_refused_naming_it():
    """Any NaN/inf among the settings (a flag, an env var, a judge option) would reach the workers
    as JSON null; `check` names it."""
    with pytest.raises(ValueError, match=r"^format_reward_weight = nan is not a finite number"):
        load_settings(environ={"FORMAT_REWARD_WEIGHT": "nan"}).check()
    with pytest.raises(ValueError, match=r"^judge_options.temperature = inf is not a finite number"):
        load_settings(flags={"judge_options": {"temperature": float("inf")}}, environ={}).check()
    with pytest.raises(ValueError, match=r"^pool.request_timeout_s = inf is not a finite number"):
        load_settings(flags={"pool": {"request_timeout_s": float("inf")}}, environ={}).check()


def test_serve_refuses_engine_vllm_where_it_cannot_run_in_one_line_naming_the_key():
    """`--engine vllm` (or REWARD_ENGINE=vllm) on a machine without CUDA or vLLM: exit 2 at
    start with the reason, not a judge load failing in a worker. Without rl-rewards[hf] the
    judge cannot load at all and that failure names the install command instead
    (test_server_load)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: vLLM may run here")
    from typer.testing import CliRunner

    from rl_rewards.cli import app

    done = CliRunner().invoke(app, ["serve", "--model", "/models/judge", "--engine", "vllm"], env={"REWARD_ENGINE": None})
    assert done.exit_code == 2, done.output
    assert done.stderr == ('rl-rewards serve: error: --engine / REWARD_ENGINE = "vllm" needs a CUDA GPU, and torch '
                           'sees none on this machine: use --engine / REWARD_ENGINE = "hf" (or "auto", which picks hf '
                           'here)\n')


def test_the_ray_serve_example_loads_and_describes_the_replicas_batcher():
    """examples/rewards/ray_serve.toml is valid settings, and its comments describe batching as
    `ray_serve.RewardReplica` does it (the server's own `Batcher`, one batch at a time), not as
    Ray Serve's `@serve.batch`, which the replicas no longer use."""
    from pathlib import Path

    example = Path(__file__).parents[4] / "examples" / "rewards" / "ray_serve.toml"
    settings = load_settings(example, environ={})
    settings.check()
    assert settings.ray_serve.batch_wait_ms == 2 and sorted(settings.rewards) == ["answer", "caption"]
    comments = " ".join(line.split("#", 1)[1].strip() for line in example.read_text().splitlines() if "#" in line)
    assert "@serve.batch" not in comments
    assert "the next batch takes every call waiting" in comments and "once the scorer is free" in comments
