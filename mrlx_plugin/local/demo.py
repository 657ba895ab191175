"""`mrlx demo`: two small models co-train on a CPU through the full multi-model loop.

The same processes as a two-model slime run, shrunk to fit a laptop: two embedded engines
(behind the real sglang-router when it is installed), the coordinator, and one trainer per
agent (`mrlx_plugin.local.trainer`, calling the plugin's rollout functions as slime does).

The task: agent A (the proposer) is asked "What is a + b?" and answers in \\boxed{}; agent B
(the decider) sees the question and A's answer and gives the team's final answer. A is rewarded
for its own answer, B for the team's. Both models are built from a config on this machine and
first taught the answer FORMAT only (a short supervised warm-start on random numbers, logged
as such); what the right answer is they learn by RL. `--freeze B` runs the same seed with B's
weights never updated: the baseline co-training has to beat.

`--adapters` runs the same two agents as two LoRA adapters of one base model: one engine serves
the base and both adapters, each agent's turns go through its own adapter, and each agent's
trainer trains and pushes only its adapter, with its own optimizer. The base stands for a
pretrained model: built from the config, it gets the format-only warm-start on both agents'
examples (how to answer, not what), and each adapter starts as the base. Everything else (the
coordinator, the steps, the plot and the metrics) is the two-model run's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from mrlx_plugin.local.procstat import memory_mib
from mrlx_plugin.local.trainer import read_rows

A, B = "proposer", "decider"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mrlx demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo", help="working directory (models, logs, checkpoints, plot)")
    p.add_argument("--steps", type=int, default=150, help="training steps (rollouts) per agent")
    p.add_argument("--prompts-per-step", type=int, default=16, help="--rollout-batch-size")
    p.add_argument(
        "--samples-per-prompt", type=int, default=16, help="--n-samples-per-prompt (GRPO group size)"
    )
    p.add_argument("--max-operand", type=int, default=3, help="questions are a + b with 0 <= a, b <= this")
    p.add_argument("--preset", default="small", help="model size (mrlx_plugin.local.model presets)")
    p.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: 2e-3; 3e-3 with --adapters)"
    )
    p.add_argument(
        "--adapters",
        action="store_true",
        help="the two agents as two LoRA adapters of one base model on one engine (each trains its own)",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank (with --adapters)")
    p.add_argument("--warmup-steps", type=int, default=80, help="format-only supervised steps (0: none)")
    p.add_argument(
        "--freeze", choices=[A, B, "A", "B"], default=None, help="never update this agent (baseline)"
    )
    add_run_options(p, resume=True)
    return p


def add_run_options(p: argparse.ArgumentParser, *, resume: bool = False, router: bool = True) -> None:
    """The options every demo has: what to do with a run already in --out (`resume`: continue it
    from its checkpoints, where the demo can), the seed, the router (`router`: where the demo
    runs one) and the progress lines."""
    again = p.add_mutually_exclusive_group()  # a run already in --out: continue it, or replace it
    if resume:
        again.add_argument(
            "--resume", action="store_true", help="continue every agent from its checkpoints in --out"
        )
    again.add_argument(
        "--overwrite",
        action="store_true",
        help="delete the run already in --out (checkpoints, metrics, logs, models) and start over",
    )
    p.add_argument("--seed", type=int, default=0)
    if router:
        p.add_argument("--no-router", action="store_true", help="talk to the engines directly")
    p.add_argument("--quiet", action="store_true", help="no progress lines or table")


def fmt(v: Any) -> str:
    """A measure in a progress line or table: three decimals, or "-" when there is none."""
    return f"{v:.3f}" if isinstance(v, float) else "-"


def write_report(out: Path, summary: dict[str, Any], rows: Any) -> dict[str, Any]:
    """`summary` and every metrics row in OUT/metrics.json; the summary names the file."""
    (out / "metrics.json").write_text(
        json.dumps({"summary": summary, "metrics": rows}, indent=1, default=str)
    )
    summary["metrics"] = str(out / "metrics.json")
    return summary


def save_plot(
    out: Path,
    draw: Callable[[Any], None],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float],
    legend: dict[str, Any],
) -> Path:
    """OUT/rewards.png: `draw(ax)` plots the lines; the frame is every demo's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    draw(ax)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(**legend)
    fig.tight_layout()
    path = out / "rewards.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def run_main(
    prog: str,
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    show: Callable[[dict[str, Any]], None],
    argv: list[str] | None,
) -> int:
    """A demo's command: parse, run, print the summary. A run that fails is one line on stderr
    and exit status 1; bad input (ConfigError) is the command line's to report (status 2)."""
    ns = parser.parse_args(argv)
    try:
        summary = run(ns)
    except RuntimeError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    show(summary)
    return 0


def _yaml(
    path: Path,
    me: str,
    urls: dict[str, str],
    models: dict[str, Path],
    coordinator: str,
    ns: Any,
    adapters: bool = False,
) -> Path:
    def agent(name: str) -> str:
        url = "self" if name == me else urls[name]
        adapter = f"adapter: {name}, " if adapters else ""  # its LoRA adapter's name on the engine
        return (
            f"    {name}: {{url: '{url}', {adapter}tokenizer: '{models[name]}', trainable: true, "
            f"sampling: {{max_new_tokens: 10, temperature: 1.0}}}}\n"
        )

    path.write_text(
        "mrlx:\n"
        f"  run_id: demo\n  system: dialogue\n  self: {me}\n"
        "  agents:\n"
        + agent(A)
        + agent(B)
        + f"  dialogue: {{first: {A}, max_turns: 2, final_answer_agent: {B}}}\n"
        "  rewards: {shaping: independent}\n"
        "  engine: {request_timeout_s: 60, abort_retry_wait_s: 0.5, peer_deadline_s: 300, sampling_seed: "
        f"{ns.seed}}}\n"
        f"  coordinator: {{url: '{coordinator}', token_env: MRLX_DEMO_TOKEN, max_staleness: 1, "
        "wait_deadline_s: 900, lease_s: 120}\n"
        f"  trainer: {{lr: {_lr(ns)}, lr_warmup_steps: 10, lr_decay_style: cosine, lr_min: {_lr(ns) / 10}, "
        "kl_coef: 0.1, ppo_epochs: 2, adam_eps: 1.0e-5, "
        f"warmup_sft_steps: {ns.warmup_steps}, warmup_sft_lr: 1.0e-3, micro_batch_size: 64, threads: 1}}\n"
    )
    return path


def warm_base(path: Path, init: Path, examples: list[Path], steps: int, seed: int) -> Path:
    """`path`: the model at `init` after `steps` format-only supervised steps on `examples` (the
    adapters' base, as a pretrained model would be), built once. The steps run in a process of
    their own, so the demo's own memory stays what it is without them."""
    import multiprocessing

    record = path / "warm_start.json"
    wanted = {"init": str(init), "examples": [str(e) for e in examples], "steps": steps, "seed": seed}
    if (path / "config.json").is_file() and record.is_file():
        have = {k: json.loads(record.read_text()).get(k) for k in wanted}
        if have != wanted:
            raise ValueError(f"{path} is a base warm-started with {have}, not {wanted}")
        return path
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=_warm_base, args=(str(path), str(init), [str(e) for e in examples], steps, seed)
    )
    proc.start()
    proc.join()
    if proc.exitcode != 0 or not (path / "config.json").is_file():
        raise RuntimeError(
            f"the warm-start of the adapters' base model in {path} failed (exit {proc.exitcode})"
        )
    return path


def _warm_base(path: str, init: str, examples: list[str], steps: int, seed: int) -> None:
    import torch

    from mrlx_plugin.local.model import load_model, load_tokenizer
    from mrlx_plugin.local.trainer import warm_start

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    final = Path(path)
    merged = final.with_name(final.name + "-warmup.jsonl")
    merged.write_text("".join(Path(e).read_text() for e in examples))
    model, tokenizer = load_model(init), load_tokenizer(init)
    losses = warm_start(model, tokenizer, str(merged), steps, 1e-3, 64, seed) if steps else [float("nan")]
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    record = {
        "init": init,
        "examples": examples,
        "steps": steps,
        "seed": seed,
        "warm_start/steps": steps,
        "warm_start/loss_first": losses[0],
        "warm_start/loss_last": losses[-1],
    }
    (tmp / "warm_start.json").write_text(json.dumps(record))
    os.replace(tmp, final)  # the base is complete or absent


def _lr(ns: Any) -> float:
    # An adapter's few parameters take larger steps than a whole model's to move it as far.
    return ns.lr if ns.lr is not None else 3e-3 if getattr(ns, "adapters", False) else 2e-3


def peak_memory_kib(pid: int) -> int:
    """The peak resident memory of process `pid` so far (0 once it has exited)."""
    try:
        return int(memory_mib(pid)[1] * 1024)
    except OSError:  # it has exited
        return 0


# What a run leaves in --out (the models, built from --preset and --seed, come back identical).
RUN_STATE = (
    A,
    B,
    "coordinator.sqlite",
    "coordinator.sqlite-wal",
    "coordinator.sqlite-shm",
    "logs",
    "metrics.json",
    "rewards.png",
)


def refuse_previous_run(out: Path, ns: argparse.Namespace, state: tuple[str, ...] = RUN_STATE) -> None:
    """Refuse to start a new run on top of an old one, unless told to continue or to replace it.

    A new run in the same folder would mix both: the trainers append to the old metrics, the
    coordinator's database holds the old run's queues, and each trainer prunes checkpoints by
    name, so the old run's later steps would outlive the new run's first one (and `--resume`
    would then continue the old run). Deleting it unasked could throw away hours of training,
    so that takes `--overwrite`."""
    found = [out / name for name in state if (out / name).exists()]
    if not found or getattr(ns, "resume", False):
        return
    if not getattr(ns, "overwrite", False):
        from mrlx_plugin.core.config import ConfigError

        resume = "--resume to continue it, " if hasattr(ns, "resume") else ""
        raise ConfigError(
            f"--out {out} already holds a run ({found[0]}); pass {resume}--overwrite to delete it and "
            "start over, or give another --out"
        )
    for path in found + [out / "models"]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def example_root(package: str, command: str) -> Path:
    """The folder holding the `examples` package whose `package` (e.g. "examples.tool_lookup") an
    example demo runs: its trainers import the example's hooks, so it goes on their PYTHONPATH."""
    import importlib

    from mrlx_plugin.core.config import ConfigError

    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ConfigError(
            f"{command}'s task is {package.replace('.', '/')} in a checkout of the project; run it from the "
            "checkout's root (or put that on PYTHONPATH)"
        ) from None
    return Path(module.__file__).resolve().parents[2]


def example_env(root: Path, **extra: str) -> dict[str, str]:
    """This process's environment with `root` first on PYTHONPATH, and `extra` variables."""
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def run_demo(ns: argparse.Namespace) -> dict[str, Any]:
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.core.processes import stop_all
    from mrlx_plugin.local.model import ensure_adapter, ensure_model
    from mrlx_plugin.local.tasks import addition_prompts, format_examples

    freeze = {"A": A, "B": B}.get(ns.freeze, ns.freeze)
    out = Path(ns.out)
    refuse_previous_run(out, ns)
    if ns.resume:  # the checkpoints in --out are whole models or adapters: resume them as they are
        from mrlx_plugin.local.model import is_adapter_dir

        held = [c for c in (_latest(out / A), _latest(out / B)) if c is not None]
        if held and is_adapter_dir(held[0]) != ns.adapters:
            kind = "a LoRA adapter" if is_adapter_dir(held[0]) else "a whole model"
            how = "with" if is_adapter_dir(held[0]) else "without"
            raise ConfigError(
                f"--resume: {held[0]} holds {kind}; resume the run {how} --adapters, as it started"
            )
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    token = secrets.token_urlsafe(24)
    env = dict(os.environ, MRLX_DEMO_TOKEN=token)

    prompts = addition_prompts(256, seed=ns.seed, max_operand=ns.max_operand)
    prompt_file = out / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt": p, "label": lab}) + "\n" for p, lab in prompts))
    warmup = {
        A: format_examples(out / f"warmup_{A}.jsonl", prompts, 2000, seed=ns.seed),
        B: format_examples(out / f"warmup_{B}.jsonl", prompts, 2000, seed=ns.seed + 1, context=True),
    }
    # The two models, each built from a config on this machine (never downloaded); with
    # --adapters, one base model and an adapter per agent on it (each starts as the base).
    adapters: dict[str, Path] = {}
    try:
        if ns.adapters:
            init = ensure_model(out / "models" / "base-init", preset=ns.preset, seed=ns.seed)
            base = warm_base(
                out / "models" / "base", init, [warmup[A], warmup[B]], 2 * ns.warmup_steps, ns.seed
            )
            models = {A: base, B: base}
            adapters = {
                name: ensure_adapter(
                    out / "models" / f"adapter-{name}",
                    base,
                    rank=ns.lora_rank,
                    alpha=2 * ns.lora_rank,
                    seed=k,
                )
                for k, name in enumerate((A, B), start=ns.seed)
            }
        else:
            models = {
                A: ensure_model(out / "models" / A, preset=ns.preset, seed=ns.seed),
                B: ensure_model(out / "models" / B, preset=ns.preset, seed=ns.seed + 1),
            }
    except (ValueError, FileExistsError) as exc:  # a model of other settings is there already
        raise ConfigError(
            f"--out {out}: {exc} (--preset, --seed and --lora-rank must match the run there)"
        ) from None

    procs: list[Any] = []
    jobs: dict[str, subprocess.Popen] = {}
    peak_kib: dict[int, int] = {}
    with ExitStack() as stack:

        def stop_everything() -> None:  # also on an exception or a signal (see mrlx_plugin.cli.main)
            stop_all(jobs.values(), timeout=20)  # the trainers first: they use the services
            stop_all([p.proc for p in procs], timeout=10)

        stack.callback(stop_everything)
        start = adapters or models
        served = {name: (_latest(out / name) if ns.resume else None) or start[name] for name in (A, B)}
        coordinator, engines, urls, use_router = start_services(
            out,
            "demo",
            served,
            procs,
            token=token,
            seed=ns.seed,
            router=not ns.no_router,
            base=models[A] if adapters else None,
        )
        configs = {
            name: _yaml(out / f"{name}.yaml", name, urls, models, coordinator.url, ns, bool(adapters))
            for name in (A, B)
        }
        for name, rollout_fn in (
            (B, "mrlx_plugin.rollout.responder_rollout"),
            (A, "mrlx_plugin.rollout.initiator_rollout"),
        ):
            extra = [
                "--num-rollout",
                str(ns.steps),
                "--prompt-data",
                str(prompt_file),
                "--rollout-batch-size",
                str(ns.prompts_per_step),
                "--n-samples-per-prompt",
                str(ns.samples_per_prompt),
                "--rollout-max-response-len",
                "24",
                # an adapter starts from the base, which had the warm-start; a model has its own
                *(["--adapter", str(adapters[name])] if adapters else ["--warmup-data", str(warmup[name])]),
            ]
            extra += (["--freeze"] if freeze == name else []) + (["--resume"] if ns.resume else [])
            jobs[name] = start_trainer(
                out,
                name,
                configs[name],
                models[name],
                engines[name],
                urls[name],
                rollout_fn,
                env,
                ns.seed,
                extra,
            )
        _follow(ns, out, jobs, procs, peak_kib)
        check_trainers(out, jobs)
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_mib = (sum(peak_kib.values()) + own) / 1024
    return _report(ns, out, time.monotonic() - started, peak_mib, freeze, use_router)


def start_services(
    out: Path,
    run_id: str,
    models: dict[str, Path],
    procs: list[Any],
    *,
    token: str,
    seed: int,
    router: bool = True,
    base: Path | None = None,
) -> tuple[Any, dict[str, str], dict[str, str], bool]:
    """The coordinator of the agents of `models`, and one engine per agent serving its model, behind
    its own sglang-router when that is installed and `router` is set; with `base`, `models` are
    LoRA adapters of `base`, and one engine (and router) serves them all, each under its agent's
    name. Each process is appended to `procs` as soon as it runs, so the caller stops it whatever
    fails next. Returns the coordinator, the engines' URLs, the URLs the agents are reached at, and
    whether routers are in front."""
    from mrlx_plugin.local.processes import router_available, start_coordinator, start_engine, start_router

    coordinator = start_coordinator(
        out / "coordinator.sqlite",
        run_id,
        list(models),
        log_dir=out / "logs",
        token_env="MRLX_DEMO_TOKEN",
        env={"MRLX_DEMO_TOKEN": token},
    )
    procs.append(coordinator)
    engines, urls = {}, {}
    use_router = router_available() and router
    served = {name: (model, []) for name, model in models.items()}
    if base is not None:  # one engine: the base, and every agent's adapter under the agent's name
        lora = ["--lora-paths", *(f"{name}={path}" for name, path in models.items())]
        served = {"-".join(models): (base, lora)}
    for label, (model, lora) in served.items():
        engine = start_engine(
            model,
            log_dir=out / "logs",
            name=f"engine-{label}",
            threads=1,
            extra=["--seed", str(seed), "--max-batch", "256", *lora],
        )
        procs.append(engine)
        url = engine.url
        if use_router:
            front = start_router([engine.url], log_dir=out / "logs", name=f"router-{label}")
            procs.append(front)
            url = front.url
        for name in models if base is not None else [label]:
            engines[name], urls[name] = engine.url, url
    return coordinator, engines, urls, use_router


def start_trainer(
    out: Path,
    name: str,
    config: Path,
    model: Path,
    engine_url: str,
    router_url: str,
    rollout_fn: str,
    env: dict[str, str],
    seed: int,
    extra: list[str],
) -> subprocess.Popen:
    """Agent `name`'s embedded trainer (its checkpoints and metrics in out/NAME, its log in
    out/logs/trainer-NAME.log), with `extra` trainer flags."""
    from mrlx_plugin.core.processes import start

    argv = [
        sys.executable,
        "-m",
        "mrlx_plugin.local.trainer",
        "--config",
        str(config),
        "--model",
        str(model),
        "--engine-url",
        engine_url,
        "--router-url",
        router_url,
        "--rollout-function",
        rollout_fn,
        "--out",
        str(out / name),
        "--seed",
        str(seed),
        *extra,
    ]
    with open(out / "logs" / f"trainer-{name}.log", "ab") as log:
        return start(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def check_trainers(out: Path, jobs: dict[str, subprocess.Popen]) -> None:
    """RuntimeError with the log's tail for a trainer that exited with an error."""
    for name, job in jobs.items():
        if job.returncode != 0:
            tail = (out / "logs" / f"trainer-{name}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the trainer of {name} failed (exit {job.returncode}):\n{tail}")


def _latest(agent_dir: Path) -> Path | None:
    found = sorted(p for p in (agent_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    return found[-1] if found else None


def _follow(
    ns: Any, out: Path, jobs: dict[str, subprocess.Popen], procs: list[Any], peak_kib: dict[int, int]
) -> None:
    """A progress bar and a per-step table while the trainers run; the peak memory of every process."""
    bar = None
    if not ns.quiet:
        from tqdm import tqdm

        bar = tqdm(total=ns.steps, desc="co-training", unit="step", dynamic_ncols=True)
        tqdm.write(
            f"{'step':>4}  {A + ' (A) right':>17}  {'team right':>10}  {B + ' (B) trained':>17}  "
            f"{'staleness':>9}  {'elapsed':>7}"
        )
    shown = 0
    t0 = time.monotonic()
    while True:
        for pid in [j.pid for j in jobs.values()] + [p.proc.pid for p in procs]:
            peak_kib[pid] = max(peak_kib.get(pid, 0), peak_memory_kib(pid))
        a_rows = [r for r in read_rows(out / A / "metrics.jsonl") if r.get("step", -1) >= 0]
        b_done = sum(1 for r in read_rows(out / B / "metrics.jsonl") if r.get("step", -1) >= 0)
        if bar is not None and len(a_rows) > shown:
            for r in a_rows[shown:]:
                bar.write(
                    f"{r['step']:>4}  {r.get(f'reward/{A}/mean', 0):>17.3f}  "
                    f"{r.get('multi_agent/team_reward', 0):>10.3f}  {b_done:>11} steps  "
                    f"{r.get(f'staleness/{B}', 0):>9.0f}  {time.monotonic() - t0:>6.0f}s"
                )
            bar.update(len(a_rows) - shown)
            bar.set_postfix_str(f"{B}: {b_done} steps trained")
        shown = len(a_rows)
        if all(j.poll() is not None for j in jobs.values()) or any(
            j.poll() not in (None, 0) for j in jobs.values()
        ):
            break
        time.sleep(0.5)
    if bar is not None:
        bar.close()


def _report(
    ns: Any, out: Path, wall: float, peak_mib: float, freeze: str | None, router: bool
) -> dict[str, Any]:
    rows = {name: [r for r in read_rows(out / name / "metrics.jsonl")] for name in (A, B)}
    steps = {name: [r for r in rows[name] if r.get("step", -1) >= 0] for name in (A, B)}
    a_rows = steps[A]

    def first_last(key: str) -> tuple[float | None, float | None]:
        values = [r[key] for r in a_rows if r.get(key) is not None]
        return (values[0], values[-1]) if values else (None, None)

    summary: dict[str, Any] = {
        "wall_time_s": wall,
        "peak_memory_mib": peak_mib,
        "frozen": freeze,
        "adapters": bool(getattr(ns, "adapters", False)),
        "router": router,
        "steps": len(a_rows),
        "seed": ns.seed,
        "agents": {},
    }
    # A's reward is A's own grade; B's is the team's final answer (what B is rewarded for).
    keys = {A: f"reward/{A}/mean", B: "multi_agent/team_reward"}
    for name in (A, B):
        first, last = first_last(keys[name])
        warm = [r for r in rows[name] if r.get("step") == -1]
        summary["agents"][name] = {
            "reward": "own answer" if name == A else "team's final answer",
            "first_step_reward": first,
            "last_step_reward": last,
            "steps_trained": len(steps[name]) if freeze != name else 0,
            "samples_trained": sum(r.get("samples", 0) for r in steps[name]) if freeze != name else 0,
            "warm_start_steps": warm[0]["warm_start/steps"] if warm else 0,
            "checkpoints": str(out / name / "checkpoints"),
        }
    base_warm = out / "models" / "base" / "warm_start.json"  # --adapters: the base's warm-start
    summary["base_warm_start"] = json.loads(base_warm.read_text()) if summary["adapters"] else None
    team = [r.get("multi_agent/team_reward") for r in a_rows if r.get("multi_agent/team_reward") is not None]
    summary["team_reward_last5"] = sum(team[-5:]) / len(team[-5:]) if team else None
    summary["plot"] = str(_plot(out, a_rows, freeze, summary["adapters"]))
    return write_report(out, summary, rows)


def _plot(out: Path, a_rows: list[dict[str, Any]], freeze: str | None, adapters: bool = False) -> Path:
    def draw(ax: Any) -> None:
        steps = [r["step"] for r in a_rows]
        for key, label in (
            (f"reward/{A}/mean", f"{A} (A): own answer"),
            ("multi_agent/team_reward", f"{B} (B): team's final answer"),
        ):
            ax.plot(steps, [r.get(key) for r in a_rows], marker="o", ms=3, label=label)

    return save_plot(
        out,
        draw,
        title=f"mrlx demo: two {'LoRA adapters of one model' if adapters else 'models'} co-training"
        + (f" ({freeze} frozen)" if freeze else ""),
        xlabel="training step",
        ylabel="mean reward (fraction right)",
        ylim=(-0.02, 1.02),
        legend={"loc": "lower right"},
    )


def print_summary(s: dict[str, Any]) -> None:
    print(
        f"\nmrlx demo finished in {s['wall_time_s']:.0f} s ({s['steps']} steps; peak memory "
        f"{s['peak_memory_mib']:.0f} MiB{'; frozen: ' + s['frozen'] if s['frozen'] else ''}"
        f"{'; two LoRA adapters on one base' if s.get('adapters') else ''})"
    )
    print(
        f"  {'agent':<10} {'rewarded for':<20} {'first step':>10} {'last step':>10} {'steps':>6} "
        f"{'samples':>8}  warm-start"
    )
    for name, a in s["agents"].items():
        print(
            f"  {name:<10} {a['reward']:<20} {fmt(a['first_step_reward']):>10} "
            f"{fmt(a['last_step_reward']):>10} "
            f"{a['steps_trained']:>6} {a['samples_trained']:>8}  {a['warm_start_steps']} format-only steps"
        )
    if s.get("base_warm_start"):
        print(
            f"  the adapters' base: {s['base_warm_start']['warm_start/steps']} format-only steps on both "
            "agents' examples; each adapter starts as the base"
        )
    print_files(s, [a["checkpoints"] for a in s["agents"].values()])


def print_measures(s: dict[str, Any], columns: list[tuple[str, str, int]], label_width: int) -> None:
    """A demo summary's table of measures: held-out before and after RL, the first and the last
    training step; `columns` are (measure, header, width)."""
    print(f"  {'':<{label_width}} " + " ".join(f"{head:>{w}}" for _, head, w in columns))
    h, t = s["held_out"], s["train"]
    for label, m in (
        (f"held-out ({h['prompts']}), before RL", h["before"]),
        (f"held-out ({h['prompts']}), after RL", h["after"]),
        ("training, first step", t["first_step"]),
        ("training, last step", t["last_step"]),
    ):
        m = m or {}
        print(f"  {label:<{label_width}} " + " ".join(f"{fmt(m.get(k)):>{w}}" for k, _, w in columns))


def print_files(s: dict[str, Any], checkpoints: list[str]) -> None:
    """Where a demo left its plot, its metrics and its checkpoints."""
    print(f"  plot: {s['plot']}\n  metrics: {s['metrics']}\n  checkpoints: {', '.join(checkpoints)}")


def main(argv: list[str] | None = None) -> int:
    return run_main("mrlx demo", build_parser(), run_demo, print_summary, argv)


if __name__ == "__main__":
    sys.exit(main())
