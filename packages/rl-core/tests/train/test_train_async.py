"""Asynchronous rollouts (`train.max_staleness`, `rl_core.train.pipeline`) on the loop's test
recipe (bandit_recipe.py): the schedule of weight versions, pinned numbers, a resume that equals
the uninterrupted run bit for bit, 2 processes = 1 process with twice the batch, the thread's
errors, and the config values refused before setup."""

from __future__ import annotations

import csv
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import bandit_recipe as bandit

from rl_core.train import (
    CopyChannel,
    RolloutPipeline,
    Sampled,
    copy_sharing_frozen,
    unknown_metric_names,
)
from rl_core.train.pipeline import compile_across_threads, version_for
from rl_core.train.testing import assert_two_processes_equal_one

SCRIPT = Path(bandit.__file__)


def rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "metrics.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def go(tmp_path: Path, name: str, *extra: str, resume: str | None = None) -> Path:
    argv = [f"train.output_dir={tmp_path}", f"train.run_name={name}", "train.max_steps=5", *extra]
    out = bandit.main([*argv, "--resume", resume] if resume else argv)
    assert out is not None
    return out


def test_versions_follow_the_bound() -> None:
    # step j samples from the weights after step max(start, j - 1 - N)
    assert [version_for(j, 0, 1) for j in range(1, 6)] == [0, 0, 1, 2, 3]
    assert [version_for(j, 0, 2) for j in range(1, 6)] == [0, 0, 0, 1, 2]
    assert [version_for(j, 3, 2) for j in range(4, 8)] == [3, 3, 3, 4]  # resumed at step 3


# batch 4 x 4, seed 0, 5 steps, one process (pinned on the 2-core CPU). The draws land on the
# same answers (the rewards agree), the weights they were drawn from do not: the gradient norms
# and the engine-vs-trainer log-prob gap of the stale steps differ (step 3: weights of step 1
# with N = 1, of step 0 with N = 2)
REWARDS = [0.1875, 0.125, 0.125, 0.4375, 0.0]
PINNED = {0: {"grad_norm": [0.1875, 0.153093, 0.165359, 0.229639, 0.0], "engine_diff": [0.0] * 5},
          1: {"grad_norm": [0.1875, 0.155772, 0.167288, 0.2321, 0.0],
              "engine_diff": [0.0, 0.0068793, 0.0086316, 0.0196251, 0.0041913]},
          2: {"grad_norm": [0.1875, 0.155772, 0.167288, 0.235121, 0.0],
              "engine_diff": [0.0, 0.0068793, 0.0088586, 0.0373460, 0.0043214]}}


@pytest.mark.parametrize("n", sorted(PINNED))
def test_staleness_schedule_and_pinned_numbers(tmp_path: Path, n: int) -> None:
    table = rows(go(tmp_path, f"s{n}", f"train.max_staleness={n}"))
    assert [float(r["reward/mean"]) for r in table] == REWARDS
    assert [float(r["grad_norm"]) for r in table] == pytest.approx(PINNED[n]["grad_norm"], abs=1e-6)
    assert [float(r["replay/engine_diff_mean"]) for r in table] == pytest.approx(PINNED[n]["engine_diff"], abs=1e-6)
    # the loop logs the optimizer steps in the weights that sampled each step (one step per update)
    assert [float(r["rollout/weight_version"]) for r in table] == [max(0, j - 1 - n) for j in range(1, 6)]
    if n == 0:  # the synchronous schedule: no staleness column, the loop's pinned run
        assert "rollout/staleness" not in table[0]
        return
    assert [float(r["rollout/staleness"]) for r in table] == [min(j - 1, n) for j in range(1, 6)]
    assert not unknown_metric_names(table[0])


def test_the_first_step_of_staleness_one_is_the_synchronous_step(tmp_path: Path) -> None:
    sync, late = rows(go(tmp_path, "sync")), rows(go(tmp_path, "late", "train.max_staleness=1"))
    for key in ("reward/mean", "loss/policy", "grad_norm", "adv/std"):
        assert sync[0][key] == late[0][key]
    assert sync[1]["grad_norm"] != late[1]["grad_norm"]  # step 2 trains on rollouts of the starting weights


def test_resume_of_an_asynchronous_run_is_bit_identical(tmp_path: Path) -> None:
    """A checkpoint holds the rollouts in flight (steps k+1..k+N): a resume from step 2 gives the
    uninterrupted run's metrics and weights exactly."""
    for n in (1, 2):
        straight = go(tmp_path, f"straight{n}", f"train.max_staleness={n}", "train.save_freq=1", "train.keep_last=9")
        assert sorted(p.name for p in (straight / "checkpoints" / "checkpoint-2" / "pipeline").iterdir()) == ["rank0.pt"]
        cut = tmp_path / f"cut{n}"
        shutil.copytree(straight, cut)
        resumed = go(tmp_path, f"cut{n}", f"train.max_staleness={n}", "train.save_freq=1", "train.keep_last=9",
                     resume=str(cut / "checkpoints" / "checkpoint-2"))
        keys = ("reward/mean", "loss/policy", "grad_norm", "adv/std", "rollout/staleness", "replay/engine_diff_mean",
                "rollout/weight_version")
        for a, b in zip(rows(straight), rows(resumed), strict=True):
            assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        torch.testing.assert_close(bandit.weights(resumed), bandit.weights(straight), atol=0, rtol=0)


def test_an_asynchronous_checkpoint_resumed_synchronously_uses_its_rollouts(tmp_path: Path) -> None:
    """max_staleness=0 after an asynchronous checkpoint: the saved rollouts are trained on first,
    then the run is synchronous (no prompt is skipped)."""
    run = go(tmp_path, "mixed", "train.max_staleness=1", "train.save_freq=1", "train.keep_last=9")
    resumed = go(tmp_path, "mixed", "train.max_staleness=0", resume=str(run / "checkpoints" / "checkpoint-3"))
    table = rows(resumed)
    assert [r["rollout/staleness"] for r in table] == ["0.0", "1.0", "1.0", "1.0", ""]


def test_two_processes_equal_one_process_with_twice_the_batch(tmp_path: Path) -> None:
    assert_two_processes_equal_one(bandit.main, SCRIPT, ["train.micro_batch_size=3", "train.max_staleness=1",
                                                         "train.max_steps=4"], tmp_path, atol=1e-7,
                                   keys=("reward/mean", "reward/std", "adv/std", "loss/policy", "grad_norm",
                                         "rollout/staleness", "replay/engine_diff_mean"))
    torch.testing.assert_close(bandit.weights(tmp_path / "two"), bandit.weights(tmp_path / "one"), atol=1e-7, rtol=0)


DYNAMIC = ("train.dynamic_sampling.enable=true", "train.dynamic_sampling.max_rounds=3")
# Dynamic sampling on the bandit (batch 4 x 4, seed 0, 5 steps, one process, pinned on the 2-core
# CPU): 4 groups per round, 4 kept, so a step of r rounds drops 4r - 4. Round 1 comes from the
# rollout thread (the weights of step j - 1 - N), the further rounds from the trainer's weights
# (staleness 0). Steps 2-4 keep a group of round 1: staleness min(j - 1, N); step 5's round 1 is
# all uniform (3 rounds, 8 dropped), its batch comes from rounds 2 and 3 alone: staleness 0 and
# the engine's log-probs are exactly the trainer's. The draws are the synchronous run's (rewards).
DS_ROUNDS, DS_DROPPED, DS_REWARDS = [2, 2, 2, 2, 3], [4, 4, 4, 4, 8], [0.375, 0.375, 0.3125, 0.5625, 0.3125]
DS_STALENESS = {1: [0, 1, 1, 1, 0], 2: [0, 1, 2, 2, 0]}


def test_dynamic_sampling_rounds_of_an_asynchronous_run_sample_the_trainers_weights(tmp_path: Path) -> None:
    for n, staleness in DS_STALENESS.items():
        table = rows(go(tmp_path, f"s{n}", f"train.max_staleness={n}", *DYNAMIC))
        assert not unknown_metric_names(table[0])
        assert [float(r["dynamic_sampling/rounds"]) for r in table] == DS_ROUNDS
        assert [float(r["dynamic_sampling/dropped_groups"]) for r in table] == DS_DROPPED
        assert [float(r["dynamic_sampling/kept_groups"]) for r in table] == [4.0] * 5
        assert [float(r["rollout/staleness"]) for r in table] == staleness
        assert [float(r["reward/mean"]) for r in table] == DS_REWARDS
        diffs = [float(r["replay/engine_diff_mean"]) for r in table]
        assert diffs[0] == diffs[4] == 0.0 and min(diffs[1:4]) > 1e-3  # stale rows only where staleness > 0


def test_resume_of_an_asynchronous_dynamic_sampling_run_is_bit_identical(tmp_path: Path) -> None:
    """Checkpoint 2 holds round 1 of step 3 (N = 1), sampled before the weights of step 2; its
    further rounds are drawn after the resume, from those weights, as in the uninterrupted run."""
    extra = ("train.max_staleness=1", "train.save_freq=1", "train.keep_last=9", *DYNAMIC)
    straight = go(tmp_path, "straight", *extra)
    cut = tmp_path / "cut"
    shutil.copytree(straight, cut)
    resumed = go(tmp_path, "cut", *extra, resume=str(cut / "checkpoints" / "checkpoint-2"))
    keys = ("reward/mean", "loss/policy", "grad_norm", "rollout/staleness", "replay/engine_diff_mean",
            "dynamic_sampling/rounds", "dynamic_sampling/dropped_groups")
    for a, b in zip(rows(straight), rows(resumed), strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    torch.testing.assert_close(bandit.weights(resumed), bandit.weights(straight), atol=0, rtol=0)


def test_an_error_on_the_rollout_thread_stops_the_run_with_it(tmp_path: Path) -> None:
    class Failing(bandit.Bandit):
        def sample(self, state: bandit.State, step: int) -> bandit.Batch:
            if step == 3:
                raise ValueError("engine lost at step 3")
            return super().sample(state, step)

    from rl_core.train import run
    with pytest.raises(RuntimeError, match=r"the rollout thread failed: ValueError\('engine lost at step 3'\)"):
        run(Failing(), [f"train.output_dir={tmp_path}", "train.run_name=f", "train.max_staleness=1",
                        "train.max_steps=5"])
    assert [r["step"] for r in rows(tmp_path / "f")] == ["1", "2"]  # the steps before it were logged
    assert not [t for t in threading.enumerate() if t.name == "rollout"]  # the thread is gone


def test_copy_channel_keeps_versions_apart() -> None:
    trained = torch.nn.Linear(3, 2)
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    model = torch.nn.Sequential(trained, frozen)
    twin = copy_sharing_frozen(model)
    assert twin[1].weight is frozen.weight and twin[0].weight is not trained.weight  # frozen: shared memory
    channel = CopyChannel(model, twin)
    channel.publish(0)
    first = trained.weight.detach().clone()
    with torch.no_grad():
        trained.weight.add_(1.0)
    channel.publish(1)
    channel.load(0, prune=False)
    torch.testing.assert_close(twin[0].weight, first, atol=0, rtol=0)
    channel.load(1)
    torch.testing.assert_close(twin[0].weight, first + 1, atol=0, rtol=0)
    assert sorted(channel.versions) == [1]  # version 0 pruned: never needed again
    with pytest.raises(KeyError, match=r"weights of step 0 were not published \(held: \[1\]\)"):
        channel.load(0)


def test_the_thread_waits_for_the_weights_it_needs() -> None:
    loaded: list[int] = []

    class Channel:
        def publish(self, version: int) -> None: ...
        def load(self, version: int, *, prune: bool = True) -> None:
            loaded.append(version)
        def close(self) -> None: ...

    pipe = RolloutPipeline(lambda step: step * 10, Channel(), start=0, total=4, max_staleness=1, pending=[])
    pipe.begin()
    first = pipe.get(1)
    assert (first.value, first.version) == (10, 0)
    got: list[Sampled] = []
    done = threading.Event()
    threading.Thread(target=lambda: (got.append(pipe.get(2)), done.set()), daemon=True).start()
    assert not done.wait(0.5)  # the second sample waits for the first update (both compile at first)
    pipe.warmed()
    assert done.wait(10) and got[0].version == 0  # ... and still samples the starting weights
    pipe.publish(1)
    assert pipe.get(3).version == 1
    got.clear()
    done.clear()
    threading.Thread(target=lambda: (got.append(pipe.get(4)), done.set()), daemon=True).start()
    assert not done.wait(0.5)  # step 4 needs the weights of step 2, not published yet
    pipe.publish(2)
    assert done.wait(10) and got[0].version == 2
    pipe.close()
    assert loaded == [0, 0, 1, 2]


def test_a_compiled_call_runs_compiled_while_another_thread_traces() -> None:
    """A trace marks the whole process as FX tracing: without `compile_across_threads` (which
    the pipeline holds from begin to close), a compiled function called on another thread meanwhile
    runs its uncompiled code; vLLM's flex attention then builds a dense score matrix (131 GiB
    asked for on an H200 with a tiny model)."""
    compiled_runs: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]):  # counts runs of the compiled graph
        def run(*args: torch.Tensor):
            compiled_runs.append(1)
            return gm.forward(*args)  # not gm(...): symbolic_trace patches Module.__call__ process-wide
        return run

    double = torch.compile(lambda x: x * 2 + 1, backend=backend)
    x = torch.ones(3)
    double(x)
    tracing, release = threading.Event(), threading.Event()

    class Traced(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            tracing.set()
            release.wait(timeout=30)
            return x + 1

    def runs_while_another_thread_traces() -> int:
        tracing.clear(), release.clear()
        tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(Traced(),))
        tracer.start()
        assert tracing.wait(timeout=30)
        before = len(compiled_runs)
        try:
            assert torch.equal(double(x), x * 2 + 1)
        finally:
            release.set()
            tracer.join()
        return len(compiled_runs) - before

    with torch._dynamo.config.patch(error_on_nested_fx_trace=False):
        assert runs_while_another_thread_traces() == 0  # torch's fallback: the uncompiled code ran
    with compile_across_threads():
        assert runs_while_another_thread_traces() == 1
    with pytest.raises(RuntimeError, match="symbolically trace"):  # torch's default (a 2-GPU run stopped on it)
        runs_while_another_thread_traces()
