"""A judge served by a real `rl-rewards serve` process on 127.0.0.1 (engine = "server")."""

from __future__ import annotations

import csv
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import TESTS, app, tiny_overrides

from rl_core.train import ConfigError
from rl_models import tiny
from rl_rewards.server.process import ServerProcess, free_port

MODULE = TESTS / "judges" / "length_judge.py"
SPEC = "length_judge"
SLOW = "slow_rule"  # a rule that takes 20 ms a sample (tests/rules/slow_rule.py)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for the module (loading torch in it takes ~1 min on 2 cores): it serves the
    test module on the tiny judge, sampling with a fixed seed, as the reward `length_judge`."""
    tmp = tmp_path_factory.mktemp("server")
    config = tmp / "server.toml"
    config.write_text(
        f"[rewards.{SPEC}.components.judge]\nscorer = \"judge\"\n"
        f"options = {{ module = \"{MODULE}\", model = \"{tiny.build('qwen3', seed=1)}\", temperature = 1.0, "
        "max_new_tokens = 4, seed = 7 }\n"
        f"[rewards.{SLOW}.components.rule]\nscorer = \"rule\"\n"
        f"options = {{ function = \"{TESTS / 'rules' / 'slow_rule.py'}:compute_score\" }}\n"
    )
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = ServerProcess(["--config", str(config)], env=env, log_path=tmp / "server.log", ready_timeout=300)
    with proc:
        yield proc.url


def judge_table(**fields: object) -> str:
    """`reward.judges` with one judge named j: mul, gated on the rule, fallback 0.25."""
    base = {"name": "j", "combine": "mul", "weight": 0.5, "gate": 1.0, "fallback": 0.25, "prompt": "prompt"} | fields
    body = ", ".join(f"{k} = {json.dumps(v)}" for k, v in base.items())
    return f"[{{{body}}}]"


def run(out: Path, judges: str) -> Path:
    return app.main(tiny_overrides(out, **{
        "reward.judges": judges, "reward.rule": f'"{TESTS}/rules/parity_rule.py"', "reward.rule_weight": 2.0,
        "reward.embedding.model": "null", "train.max_steps": 1, "train.samples_to_log": 100, "train.batch_size": 4,
    }))


def served_samples(url: str) -> float:
    """Samples the server has scored for the spec (its Prometheus counter)."""
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f'rl_rewards_samples_total{{reward="{SPEC}"}}'):
            return float(line.rpartition(" ")[2])
    return 0.0


def metrics(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def train_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples" / "train.jsonl").read_text().splitlines()]


def test_served_judge_scores_like_the_same_judge_in_process(server: str, tmp_path: Path) -> None:
    """Same module, model and seeded sampling, once in process and once behind the server: the
    gate, the mul fold, the fallback for unparseable outputs and the counters all agree."""
    local = run(tmp_path / "local", judge_table(module=str(MODULE), model="tiny:qwen3:1", temperature=1.0,
                                                max_new_tokens=4, seed=7))
    before = served_samples(server)
    served = run(tmp_path / "served", judge_table(engine="server", url=server, spec=SPEC))
    a, b = train_rows(local), train_rows(served)
    assert len(a) == len(b) == 8
    passed = [r for r in b if r["components"]["rule"] >= 1.0]
    failed = [r for r in b if r["judges"]["j"]["error"] is not None]
    assert passed and len(passed) < 8, "the parity rule should split the samples"
    assert failed and len(failed) < len(passed), "the judge should both score and fail some outputs"
    for x, y in zip(a, b, strict=True):
        assert x["completion"] == y["completion"]
        assert y["reward"] == pytest.approx(x["reward"], abs=1e-12)
        assert y["components"]["j"] == pytest.approx(x["components"]["j"], abs=1e-12)
        assert (x["judges"]["j"]["error"] is None) == (y["judges"]["j"]["error"] is None)
        assert x["judges"]["j"]["judged"] == y["judges"]["j"]["judged"] == (x["components"]["rule"] >= 1.0)
        assert y["judges"]["j"]["raw"] is None  # the server returns scores, not the judge's text
    for r in failed:
        assert r["components"]["j"] == 0.25 and "unreadable judge output" in r["judges"]["j"]["error"]
    rows_a, rows_b = metrics(local), metrics(served)
    for key in ("reward/mean", "judge/j/scored", "judge/j/parse_failures", "reward/j"):
        assert rows_a[0][key] == rows_b[0][key], key
    assert rows_b[0]["judge/j/request_failures"] == "0"
    # gated-out samples never reached the server: it scored the dry-run sample, the passing
    # training samples and the passing evaluation samples, nothing else
    sent = 1 + int(rows_b[0]["judge/j/scored"]) + int(rows_b[0]["eval/judge/j/scored"])
    assert served_samples(server) - before == sent


def test_streamed_scoring_gives_the_after_batch_rewards(server: str, tmp_path: Path) -> None:
    """reward.stream (the default): each prompt's samples go to the server as soon as they are
    sampled (rollout.per_prompt_seeds), scored while the next prompt samples; the step is the
    same as with the samples scored after the whole batch: rewards, sample rows, the update."""
    def step(name: str, stream: bool) -> Path:
        return app.main(tiny_overrides(tmp_path / name, **{
            "reward.judges": judge_table(engine="server", url=server, spec=SLOW), "reward.stream": str(stream).lower(),
            "reward.rule": f'"{TESTS}/rules/parity_rule.py"', "reward.embedding.model": "null",
            "rollout.per_prompt_seeds": "true", "train.max_steps": 1, "train.samples_to_log": 100,
            "train.batch_size": 4}))

    streamed, after = step("streamed", True), step("after", False)
    a, b = metrics(streamed)[0], metrics(after)[0]
    assert float(a["judge/j/scored"]) > 0 and a["reward/failed"] == "0.0"
    for key in ("reward/mean", "reward/std", "reward/j", "judge/j/scored", "loss/policy", "grad_norm"):
        assert a[key] == b[key], key
    assert train_rows(streamed) == train_rows(after)
    assert float(a["time/judge_j_score"]) > 0  # the worker's judge phase is in the step's row
    print(f"\ntime/reward streamed {float(a['time/reward']):.3f} s, after the batch {float(b['time/reward']):.3f} s")


def test_streamed_scoring_in_an_asynchronous_run_gives_the_after_batch_steps(server: str, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """train.max_staleness=1: the rollout thread's samples are scored on its scoring worker, one
    request per prompt as it is sampled, not on the trainer's thread; the reward phase takes
    their rewards. Dynamic sampling's further rounds sample on the trainer's thread, each scored
    on a worker of its own, beside the rollout thread's (one scoring at a time). The 2 steps
    (step 2 sampled from the starting weights and held in flight by checkpoint 1, pickled with
    its rewards) equal those scored after the batch on the trainer's thread: rewards, judge
    counters (each step's own, from its chunks), rounds, sample rows, the update."""
    import rider_recipe

    real, threads = rider_recipe.score_now, []

    def score_now(state: object, samples: list) -> tuple:  # the real scoring; records where it ran
        threads.append(threading.current_thread().name)
        return real(state, samples)

    monkeypatch.setattr(rider_recipe, "score_now", score_now)

    def steps(name: str, stream: bool) -> tuple[Path, list[str]]:
        threads.clear()
        out = app.main(tiny_overrides(tmp_path / name, **{
            "reward.judges": judge_table(engine="server", url=server, spec=SLOW), "reward.stream": str(stream).lower(),
            "reward.rule": f'"{TESTS}/rules/parity_rule.py"', "reward.embedding.model": "null",
            "rollout.per_prompt_seeds": "true", "train.max_steps": 2, "train.save_freq": 1, "train.max_staleness": 1,
            "train.dynamic_sampling.enable": "true", "train.dynamic_sampling.max_rounds": 3,
            "algo.rollout_correction": '"token_truncate"', "train.samples_to_log": 100, "train.batch_size": 4}))
        return out, list(threads)

    (streamed, where), (after, after_where) = steps("streamed", True), steps("after", False)
    a, b = metrics(streamed), metrics(after)
    rounds = sum(int(float(r["dynamic_sampling/rounds"])) for r in a)
    assert rounds == 4  # the parity rule leaves uniform groups: each step takes a second round
    # 4 prompts a round, each its own chunk on a scoring worker; the evaluation on this thread
    assert where == ["rl-rollout-score_0"] * 4 * rounds + ["MainThread"], where
    assert after_where == ["MainThread"] * (rounds + 1), after_where
    assert [r["step"] for r in a] == ["1", "2"] and a[1]["rollout/staleness"] == "1.0"
    for row in a:  # each step's own judge work, and the worker's judge phase in the step that used it
        assert float(row["judge/j/scored"]) > 0 and float(row["time/judge_j_score"]) > 0, row["step"]
    for x, y in zip(a, b, strict=True):
        for key in ("reward/mean", "reward/std", "reward/j", "judge/j/scored", "loss/policy", "grad_norm",
                    "rollout/staleness", "dynamic_sampling/kept_groups", "dynamic_sampling/metric_mean"):
            assert x[key] == y[key], (x["step"], key)
    assert train_rows(streamed) == train_rows(after)
    print(f"\ntime/reward streamed {[r['time/reward'] for r in a]} s, after the batch {[r['time/reward'] for r in b]} s")


def test_unknown_spec_fails_at_startup_listing_the_served_ones(server: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=rf"does not serve spec 'nope'; it serves {SPEC}"):
        run(tmp_path, judge_table(engine="server", url=server, spec="nope"))
    assert not (tmp_path / "latest").exists()  # failed before the run directory was made


def test_server_down_fails_at_startup(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=rf"judge 'j': no rl-rewards server answers at {url}"):
        run(tmp_path, judge_table(engine="server", url=url, spec=SPEC))


def test_server_judge_needs_url_and_spec(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"reward.judges\[0\] \(engine = 'server'\) needs url .* and spec"):
        run(tmp_path, judge_table(engine="server", url="http://127.0.0.1:1"))


class _Answers(http.server.BaseHTTPRequestHandler):
    """A server that answers every POST with `status` and an HTML page (no wire format)."""

    status = 200

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = b"<html>upstream error</html>"
        self.send_response(self.status)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize(("status", "parse", "failed_request"), [(200, 2, 0), (503, 0, 2)])
def test_a_garbage_answer_is_a_parse_failure_and_a_failed_request_is_not(status: int, parse: int,
                                                                         failed_request: int) -> None:
    """Each failed sample is counted once: a 200 that is not our wire format in parse_failures, an
    HTTP error after the retries in request_failures."""
    from judging import Judge

    from rl_core.train import PhaseTimer
    from rl_rewards import Sample
    from rl_rewards.client import RemoteScorer, RetryPolicy

    handler = type("Answers", (_Answers,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        scorer = RemoteScorer(f"http://127.0.0.1:{server.server_address[1]}", "j", timeout=5.0,
                              retry=RetryPolicy(attempts=1))
        judge = Judge("j", 0, scorer, PhaseTimer(), use_rm_prompt=False)
        samples = [Sample(completion=c, prompt="p", metadata={"uid": i, "data_source": "d", "extra_info": {}})
                   for i, c in enumerate(("a", "b"))]
        results = judge.score(samples)
    finally:
        server.shutdown()
        server.server_close()
    assert all(r.score is None and r.error for r in results)
    assert (judge.log.failures, judge.log.request_failures) == (parse, failed_request)
