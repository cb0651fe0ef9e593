"""Exactly-once resume under faults: SIGKILLs at random points during asynchronous runs.

For each app (caption-rl, rider-grm) the script runs one uninterrupted run, then one run per
target, killing it `--kills` times in all (split evenly over the app x target cells) with SIGKILL:

- `trainer`: the training process; the script resumes it with `--resume RUN_DIR`.
- `actor`: the Ray actor that holds the policy's rollout engine (`rollout.workers=1`); the
  running trainer must survive it (`rl_rollout.ray_pool` restarts the actor with the latest
  weights and retries its shard once).
- `reward-worker`: one of the `rl-rewards serve --workers 2` worker processes scoring the
  streamed rewards; the running trainer must survive it (the server's router retries the chunk
  on the other worker and restarts the dead one).

Every run is the app's tiny CPU model, asynchronous (`train.max_staleness=2`, TIS), seeded per
prompt (`rollout.per_prompt_seeds`), checkpointing every step (`train.save_freq=1`), its rewards
streamed from a served reward (caption-rl: CapRL's /get_reward QA judge; rider-grm: a served
judge, `engine = "server"`), its engine in one Ray actor on a private Ray cluster the script
starts (`rollout.ray_address`). Then each faulted run is compared with the uninterrupted one:
every metrics.csv row (wall times and throughput left out) must be equal, key for key, and each
step must train the same prompts (`samples/prompts.jsonl`, `RunContext.record_prompts`).

Kill points are drawn from `--seed`. Trainer kills alternate: the odd ones land uniformly within
2 step-times after a new step is logged (the step's checkpoint, the next step, a rollout or a
scoring on the threads), the even ones uniformly within one start-up time (the uninterrupted
run's, launch to first step) of the relaunch: in the resumed trainer's start-up (imports, the Ray
actor's start, the checkpoint and the rollouts in flight restored) or, when it started faster,
in its first steps. An actor or reward-worker kill lands uniformly within 1.5 step-times after a
new step is logged, one kill per logged step (a second death of the same actor on the same shard
is documented as fatal: `WorkerDiedError`).

    uv run python benchmarks/fault_resume.py                        # both apps, 30 kills, appends to RESULTS.md
    uv run python benchmarks/fault_resume.py --app rider-grm --kills 6 --seed 1 --no-results
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import csv
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.results import append_results  # noqa: E402

APPS = ("caption-rl", "rider-grm")
TARGETS = ("trainer", "actor", "reward-worker")
TIMED = ("time/", "throughput/")  # wall-clock metrics: they differ between any two runs
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONUNBUFFERED": "1",
       # `ray start` turns on token authentication (~/.ray/auth_token): the trainers must send it too
       "RAY_AUTH_MODE": "token",
       # Ray's raylet waits 15 s by default for its agents to start: too short on 2 loaded cores
       "RAY_agent_register_timeout_ms": "120000"}
SPEC = "fault_judge"
JUDGE_MODULE = '''"""A served judge whose score is read off its sampled text (so a rescored chunk that sampled
anything else would show): the text's length mod 10, over 10."""


def rm_preprocess(text_prompts, text_responses, tgt_tokenizer):
    return [tgt_tokenizer.apply_chat_template([{"role": "user", "content": f"{p}\\nReply: {r}\\nScore it."}],
                                              tokenize=False, add_generation_prompt=True)
            for p, r in zip(text_prompts, text_responses, strict=True)]


def rm_postprocess(results):
    return [len(text) % 10 / 10 for text in results]
'''


# -- processes ------------------------------------------------------------------------------------

def session_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[3])  # after "pid (comm)": state ppid pgrp session


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except OSError:
        return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def in_session(sid: int) -> list[int]:
    return [p for p in pids() if session_of(p) == sid]


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (one this script started), by pid."""
    for pid in in_session(sid):
        kill(pid)


class RayHead:
    """A private Ray cluster (`ray start --head`, its own temp dir, so no other `ray.init()` on
    the machine finds it), killed by pid at the end."""

    def __init__(self, tmp: Path) -> None:
        from rl_rewards.server.process import free_port

        self.temp = Path(tempfile.mkdtemp(prefix="fr-ray-", dir="/tmp"))  # short: Ray's socket paths
        self.port, self.sid = free_port(), 0
        cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--node-ip-address=127.0.0.1",
               f"--port={self.port}", "--num-cpus=8", "--include-dashboard=false", "--disable-usage-stats",
               f"--temp-dir={self.temp}"]
        for _ in range(3):
            with (tmp / "ray.log").open("ab") as log:
                proc = subprocess.Popen(cmd, env={**os.environ, **ENV}, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            self.sid = proc.pid
            if proc.wait(timeout=300) == 0:
                return
            kill_session(self.sid)
        raise RuntimeError(f"ray start failed 3 times: {(tmp / 'ray.log').read_text()[-2000:]}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def actors(self) -> list[int]:
        return [p for p in in_session(self.sid) if cmdline(p).startswith("ray::EngineWorker")]

    def close(self) -> None:
        kill_session(self.sid)


# -- the apps -------------------------------------------------------------------------------------

def overrides(app: str, out: Path, steps: int, ray: str, reward_url: str) -> list[str]:
    """The app's tiny CPU config, asynchronous, checkpointing every step, rewards served."""
    common = [f"train.output_dir={out}", "train.run_name=run", f"train.max_steps={steps}", "train.epochs=20",
              "train.save_freq=1", "train.keep_last=2", "train.max_staleness=2", "train.lr=1e-2",
              "algo.rollout_correction=token_truncate", "rollout.per_prompt_seeds=true", "rollout.engine=hf",
              "rollout.workers=1", "rollout.placement=split", f"rollout.ray_address={ray}"]
    if app == "caption-rl":
        data = ROOT / "examples" / "data"
        return [*common, f"data.train_files=[\"{data / 'caption_qa_images.jsonl'}\", \"{data / 'caption_qa_videos.jsonl'}\"]",
                "data.eval_size=0", "data.video_max_frames=4", "data.max_pixels=3136", "model.lora_rank=0",
                "rollout.n=4", "rollout.max_new_tokens=8", "train.batch_size=2", "train.micro_batch_size=8",
                "train.eval_freq=0", f"reward.url={reward_url}/get_reward"]
    judge = (f'[{{name = "served", engine = "server", url = "{reward_url}", spec = "{SPEC}", weight = 0.5, '
             'combine = "add", prompt = "prompt"}]')
    return [*common, f"reward.judges={judge}", "reward.embedding.model=null", "rollout.n=2",
            "rollout.max_new_tokens=8", "train.batch_size=2", "train.mini_batch_size=2", "train.micro_batch_size=4"]


def reward_server(app: str, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """`rl-rewards serve` flags and environment for the app's served reward, 2 worker processes."""
    # --max-batch-size: a scoring batch is one request's piece whatever the timing. A judge's
    # numbers depend on what else is in its batch (padding, batch shape), and a chunk retried
    # after a worker died lands next to another request's samples: bit-exact runs need fixed batches
    if app == "caption-rl":  # CapRL's /get_reward in QA mode, the tiny judge (as caption-rl's tests serve it)
        return ["--workers", "2", "--max-batch-size", "4"], {"REWARD_MODEL": "tiny:qwen3", "REWARD_TASK": "video"}
    module, config = tmp / "fault_judge.py", tmp / "server.toml"
    module.write_text(JUDGE_MODULE)
    config.write_text(f'[rewards.{SPEC}.components.judge]\nscorer = "judge"\n'
                      f'options = {{ module = "{module}", model = "tiny:qwen3:1", temperature = 1.0, '
                      "max_new_tokens = 4, seed = 7 }\n")
    return ["--config", str(config), "--workers", "2", "--max-batch-size", "2"], {}


def read_rows(run: Path) -> list[dict[str, str]]:
    """metrics.csv's complete rows (the trainer may be appending one)."""
    path = run / "metrics.csv"
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()[: text.count("\n")]  # a line without its newline is still being written
    return list(csv.DictReader(lines))


def logged(run: Path) -> int:
    return len(read_rows(run))


def has_checkpoint(run: Path) -> bool:
    return any((run / "checkpoints").glob("checkpoint-*/meta.json"))


# -- one run, killed ------------------------------------------------------------------------------

@dataclass
class Cell:
    """One app x target: what was killed, when, and what the comparison found."""

    app: str
    target: str
    kills: list[dict[str, object]] = field(default_factory=list)
    resumes: int = 0
    died: list[str] = field(default_factory=list)  # trainer exits the script did not cause
    leaked: int = 0  # actors left by a killed trainer, killed by the script
    restarts: int = 0  # reward workers the server restarted (its log)
    rows: int = 0
    mismatches: list[str] = field(default_factory=list)
    lost: int = 0
    duplicated: int = 0
    seconds: float = 0.0


class Trainer:
    """The app's training process (its own session), resumed as needed."""

    def __init__(self, app: str, argv: list[str], run: Path, log: Path) -> None:
        self.app, self.argv, self.run, self.log = app, argv, run, log
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0

    def launch(self, resume: bool) -> None:
        cmd = [sys.executable, str(ROOT / "apps" / self.app), *self.argv, *(["--resume", str(self.run)] if resume else [])]
        with self.log.open("ab") as out:
            out.write(f"\n=== {' '.join(cmd[2:3])} {'--resume' if resume else ''} at {time.strftime('%X')}\n".encode())
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **ENV}, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        kill(self.proc.pid)
        self.proc.wait()
        kill_session(self.proc.pid)  # anything it started

    def wait_for_row(self, count: int, timeout: float = 900.0) -> bool:
        """Until metrics.csv holds `count` rows (True) or the trainer exited (False)."""
        deadline = time.monotonic() + timeout
        while logged(self.run) < count:
            if not self.alive() or time.monotonic() > deadline:
                return logged(self.run) >= count
            time.sleep(0.05)
        return True


def sleep_alive(trainer: Trainer, seconds: float) -> bool:
    """Sleep `seconds` unless the trainer exits first; whether it is still running."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not trainer.alive():
            return False
        time.sleep(0.02)
    return trainer.alive()


def target_pid(target: str, ray: RayHead, server: subprocess.Popen[bytes], rng: random.Random) -> int | None:
    if target == "actor":
        found = ray.actors()
    else:
        found = sorted(p for p in pids() if parent_of(p) == server.pid and "rl_rewards.server.workers" in cmdline(p))
    return rng.choice(found) if found else None


def faulted_run(cell: Cell, count: int, trainer: Trainer, ray: RayHead, server: subprocess.Popen[bytes],
                rng: random.Random, step_s: float, startup_s: float, total: int) -> None:
    """Run the trainer to the end, killing `cell.target` `count` times at random points
    (`step_s`, `startup_s`: the uninterrupted run's seconds a step and before its first step)."""
    trainer.launch(resume=False)
    while len(cell.kills) < count:
        seen = logged(trainer.run)
        if cell.target == "trainer" and len(cell.kills) % 2 and has_checkpoint(trainer.run):
            delay, where = rng.uniform(0.0, startup_s), "within a start-up time of a relaunch"
            if not sleep_alive(trainer, delay):
                break
        else:
            if seen >= total or not trainer.wait_for_row(seen + 1):
                break
            delay, where = rng.uniform(0.0, (2.0 if cell.target == "trainer" else 1.5) * step_s), "after a step"
            if not sleep_alive(trainer, delay):
                break
        at = {"target": cell.target, "rows": logged(trainer.run), "delay_s": round(delay, 2), "where": where,
              "rows_before": cell.kills[-1]["rows"] if cell.kills else 0}  # rows unchanged: no step since the last kill
        if cell.target == "trainer":
            trainer.kill()
            cell.kills.append(at)
            cell.leaked += reap_actors(ray)
            trainer.launch(resume=has_checkpoint(trainer.run))  # killed before its first checkpoint: anew
            cell.resumes += 1
            continue
        pid = target_pid(cell.target, ray, server, rng)
        if pid is None:
            continue  # none running at this instant (an actor restarting): draw another point
        at |= {"pid": pid, "process": cmdline(pid)[:60]}
        kill(pid)
        cell.kills.append(at)
    finish(cell, trainer, ray)


def finish(cell: Cell, trainer: Trainer, ray: RayHead) -> None:
    """Wait for the trainer to end; one that dies on its own is noted and resumed."""
    assert trainer.proc is not None
    for _ in range(5):
        code = trainer.proc.wait(timeout=1800)
        if code == 0:
            return
        lines = trainer.log.read_text(errors="replace").splitlines()
        last = next((line for line in reversed(lines) if "rror" in line), lines[-1] if lines else "")
        cell.died.append(f"exit {code} after {logged(trainer.run)} rows: {last.strip()[:200]}")
        kill_session(trainer.proc.pid)
        cell.leaked += reap_actors(ray)
        trainer.launch(resume=has_checkpoint(trainer.run))
        cell.resumes += 1
    raise RuntimeError(f"{cell.app} ({cell.target} killed): the trainer failed 5 times; see {trainer.log}")


def reap_actors(ray: RayHead, grace: float = 30.0) -> int:
    """After the trainer died: Ray ends its actors (the job's driver is gone); any still running
    after `grace` seconds is killed here and counted."""
    deadline = time.monotonic() + grace
    while ray.actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = ray.actors()
    for pid in left:
        kill(pid)
    return len(left)


# -- comparison -----------------------------------------------------------------------------------

def prompts(run: Path) -> dict[int, list[int]]:
    lines = (run / "samples" / "prompts.jsonl").read_text().splitlines()
    return {row["step"]: row["prompts"] for row in map(json.loads, lines)}


def compare(cell: Cell, straight: Path, faulted: Path) -> None:
    """Every row of `faulted` against `straight`'s (same non-empty keys, equal values, wall
    times left out); prompts lost or trained twice over the run, per prompt id."""
    def untimed(run: Path) -> dict[str, dict[str, str]]:
        return {r["step"]: {k: v for k, v in r.items() if v != "" and not k.startswith(TIMED)} for r in read_rows(run)}

    a, b = untimed(straight), untimed(faulted)
    cell.rows = len(b)
    for step in sorted(set(a) | set(b), key=int):
        x, y = a.get(step), b.get(step)
        if x != y:
            keys = sorted(k for k in set(x or {}) | set(y or {}) if (x or {}).get(k) != (y or {}).get(k))
            cell.mismatches.append(f"step {step}: " + ", ".join(
                f"{k} {(x or {}).get(k, '-')} vs {(y or {}).get(k, '-')}" for k in keys[:4]))
    pa, pb = prompts(straight), prompts(faulted)
    trained_a = collections.Counter(i for ids in pa.values() for i in ids)
    trained_b = collections.Counter(i for ids in pb.values() for i in ids)
    cell.lost = sum((trained_a - trained_b).values())
    cell.duplicated = sum((trained_b - trained_a).values())
    cell.mismatches += [f"step {s}: prompts {pa.get(s)} vs {pb.get(s)}" for s in sorted(set(pa) | set(pb))
                        if pa.get(s) != pb.get(s)]


# -- the whole benchmark --------------------------------------------------------------------------

def split_kills(total: int, cells: int) -> list[int]:
    return [total // cells + (i < total % cells) for i in range(cells)]


def run_app(app: str, counts: list[int], tmp: Path, ray: RayHead, rng: random.Random) -> list[Cell]:
    from rl_rewards.server.process import ServerProcess

    out = tmp / app
    out.mkdir()
    args, env = reward_server(app, out)
    steps = 2 * max(counts) + 4  # room for a kill per logged step, and the lost steps of trainer kills
    cells: list[Cell] = []
    with ServerProcess(args, env={**ENV, **env}, log_path=out / "server.log", ready_timeout=600) as server:
        assert server.proc is not None
        argv = overrides(app, out / "straight", steps, ray.address, server.url)
        began = time.monotonic()
        straight = Trainer(app, argv, out / "straight" / "run", out / "straight.log")
        straight.launch(resume=False)
        seen = [time.monotonic()]  # launch, then each row's arrival
        while straight.wait_for_row(len(seen)):
            seen.append(time.monotonic())
        if straight.proc is None or straight.proc.wait(timeout=600) != 0 or len(seen) != steps + 1:
            raise RuntimeError(f"{app}: the uninterrupted run failed; see {straight.log}")
        startup_s, step_s = seen[1] - seen[0], (seen[-1] - seen[1]) / (steps - 1)  # wall clock, checkpoints included
        print(f"{app}: uninterrupted run, {steps} steps in {time.monotonic() - began:.0f} s ({startup_s:.0f} s to "
              f"the first step, then {step_s:.2f} s a step)", flush=True)
        for target, count in zip(TARGETS, counts, strict=True):
            cell, began = Cell(app, target), time.monotonic()
            name = f"fault-{target}"
            trainer = Trainer(app, overrides(app, out / name, steps, ray.address, server.url), out / name / "run",
                              out / f"{name}.log")
            faulted_run(cell, count, trainer, ray, server.proc, rng, step_s, startup_s, steps)
            cell.seconds = time.monotonic() - began
            compare(cell, straight.run, trainer.run)
            if target == "reward-worker":  # the only cell that kills them: the server's own count
                cell.restarts = (out / "server.log").read_text(errors="replace").count("is down; restarting it")
            print(f"{app}: {target} killed {len(cell.kills)} times, {cell.resumes} resumes, "
                  f"{len(cell.mismatches)} mismatches, {cell.seconds:.0f} s", flush=True)
            for line in [*cell.died, *cell.mismatches[:5]]:
                print(f"  {line}", flush=True)
            cells.append(cell)
    return cells


def report(cells: list[Cell], args: argparse.Namespace, seconds: float, tmp: Path) -> None:
    header = ["app", "target killed", "kills", "resumes", "rows compared", "mismatches", "prompts lost",
              "prompts duplicated"]
    rows = [[c.app, c.target, len(c.kills), c.resumes, c.rows, len(c.mismatches), c.lost, c.duplicated] for c in cells]
    kills = sum(len(c.kills) for c in cells)
    died = [f"{c.app}/{c.target}: {d}" for c in cells for d in c.died]
    leaked = sum(c.leaked for c in cells)
    where = collections.Counter(str(k["where"]) for c in cells for k in c.kills)
    relaunch = [k for c in cells for k in c.kills if k["where"] != "after a step"]
    early = sum(k["rows"] == k["rows_before"] for k in relaunch)  # the resumed trainer had logged no step yet
    actors = [c for c in cells if c.target == "actor"]
    fresh = sum(len({k["pid"] for k in c.kills}) for c in actors)  # each kill found a new actor: the pool restarted it
    workers = [c for c in cells if c.target == "reward-worker"]
    notes = (f"`benchmarks/fault_resume.py --kills {args.kills} --seed {args.seed} --app {args.app}` on this 2-core CPU "
             f"machine (shared with other jobs), {seconds / 60:.1f} min in all. {kills} SIGKILLs at points drawn from "
             f"seed {args.seed} ({', '.join(f'{n} {w}' for w, n in where.items())}; the module doc says how; "
             f"{early} of the {len(relaunch)} near a relaunch came before the resumed trainer logged a step). "
             "Each app: one uninterrupted run, then one run per target with the same config (tiny CPU model, "
             "train.max_staleness=2, TIS, rollout.per_prompt_seeds, train.save_freq=1, the engine in one Ray actor "
             "on a private Ray cluster, rewards streamed from `rl-rewards serve --workers 2`). Rows compared: "
             "every metrics.csv row of the faulted run, key for key and exactly (tolerance 0), wall times "
             "(time/*, throughput/*) left out; prompts: the data indices trained at each step "
             "(samples/prompts.jsonl). Resumes: the trainer relaunched after a kill (with --resume, or anew when "
             "killed before its first checkpoint); in an actor or reward-worker run, after a death those kills "
             f"caused. Trainer exits the script did not cause: {len(died)}"
             f"{' (' + '; '.join(died) + ')' if died else ''}. The {sum(len(c.kills) for c in actors)} actor kills "
             f"hit {fresh} different actor processes (the pool started a new one after each); the "
             f"reward servers logged {sum(c.restarts for c in workers)} worker restarts for "
             f"{sum(len(c.kills) for c in workers)} worker kills. Actors a killed trainer left running after 30 s: "
             f"{leaked}.")
    if args.no_results:
        from benchmarks.results import markdown_table

        print(markdown_table(header, rows), notes, sep="\n\n")
    else:
        append_results("Exactly-once resume under SIGKILLs (caption-rl, rider-grm; CPU, 2 cores)", header, rows, notes)
    details = tmp / "kills.json"
    details.write_text(json.dumps([c.__dict__ for c in cells], indent=1, default=str))
    print(f"kill points and mismatches: {details}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=30, help="SIGKILLs in all, split over the app x target cells (30)")
    parser.add_argument("--seed", type=int, default=0, help="draws the kill points and the killed worker (0)")
    parser.add_argument("--app", choices=[*APPS, "all"], default="all", help="which app (all)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the runs and logs in this folder")
    parser.add_argument("--no-results", action="store_true", help="print the table, do not append to RESULTS.md")
    args = parser.parse_args()
    apps = APPS if args.app == "all" else (args.app,)
    if args.kills < len(apps) * len(TARGETS):
        parser.error(f"--kills {args.kills}: at least one per app and target ({len(apps) * len(TARGETS)})")
    counts = split_kills(args.kills, len(apps) * len(TARGETS))
    rng, began = random.Random(args.seed), time.monotonic()
    tmp = args.keep or Path(tempfile.mkdtemp(prefix="fault-resume-"))
    tmp.mkdir(parents=True, exist_ok=True)
    ray = RayHead(tmp)
    try:
        cells = [c for i, app in enumerate(apps) for c in run_app(app, counts[3 * i: 3 * i + 3], tmp, ray, rng)]
    finally:
        ray.close()
    report(cells, args, time.monotonic() - began, tmp)


if __name__ == "__main__":
    main()
