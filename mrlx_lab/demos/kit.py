"""What every demo shares: its command line (`add_training_options`, `add_warm_start_options`,
`add_evaluation_options`, `add_run_options`, `run_main`), what a run already in
--out is (`refuse_previous_run`), starting the services and the trainers (`start_services`,
`trainer_flags`, `start_trainer`; `tools_system_text` for the demos whose agents call tools),
following the run (`Running`), and its report: metrics.json
(`write_report`), the plot (`save_plot`) and the summary's tables (`fmt`, `print_measures`,
`print_files`)."""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from mrlx_lab.procstat import memory_mib
from mrlx_plugin.core.values import JSONObject

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from mrlx_plugin.local.services import ManagedProcess

# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------


def add_training_options(
    p: argparse.ArgumentParser,
    *,
    out: str,
    steps: int,
    steps_help: str,
    prompts_per_step: int,
    samples_per_prompt: int,
    lr: float | None,
    lr_help: str = "learning rate",
) -> None:
    """The options of what a demo trains: where, how many steps, the episodes of a step, the
    models' size, the learning rate (each demo gives its defaults)."""
    p.add_argument("--out", default=out, help="working directory (models, logs, checkpoints, plot)")
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--prompts-per-step", type=int, default=prompts_per_step, help="--rollout-batch-size")
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=samples_per_prompt,
        help="--n-samples-per-prompt (GRPO group size)",
    )
    p.add_argument("--preset", default="small", help="model size (mrlx_plugin.local.model presets)")
    p.add_argument("--lr", type=float, default=lr, help=lr_help)


def add_warm_start_options(p: argparse.ArgumentParser, *, per_agent: bool) -> None:
    """The options of the agent-code demos' supervised warm-start (each agent's, with `per_agent`),
    and of keeping the samples they train on."""
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=1200,
        help=f"supervised warm-start steps{' per agent' if per_agent else ''} (0: none)",
    )
    p.add_argument("--warmup-lr", type=float, default=2e-3, help="learning rate of the warm-start")
    p.add_argument(
        "--save-samples",
        action="store_true",
        help=f"write every trained sample to {'AGENT/' if per_agent else ''}samples.jsonl",
    )


def add_evaluation_options(p: argparse.ArgumentParser, *, prompts: int, interval: int, what: str) -> None:
    """The options of a demo's held-out evaluation: how many held-out `what` (prompts, questions),
    and how often."""
    p.add_argument("--eval-prompts", type=int, default=prompts, help=f"held-out {what} per evaluation")
    p.add_argument(
        "--eval-interval", type=int, default=interval, help="evaluate every N steps (and before, after)"
    )


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


def run_main(
    prog: str,
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], JSONObject],
    show: Callable[[JSONObject], None],
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


def refuse_previous_run(out: Path, ns: argparse.Namespace, state: tuple[str, ...]) -> None:
    """Refuse to start a new run on top of an old one (`state`: what a run leaves in --out),
    unless told to continue or to replace it.

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


# ----------------------------------------------------------------------------------------------
# The processes of a run
# ----------------------------------------------------------------------------------------------


def start_services(
    out: Path,
    run_id: str,
    models: dict[str, Path],
    services: list[ManagedProcess],
    *,
    token: str,
    seed: int,
    router: bool = True,
    base: Path | None = None,
) -> tuple[ManagedProcess, dict[str, str], dict[str, str], bool]:
    """The coordinator of the agents of `models`, and one engine per agent serving its model, behind
    its own sglang-router when that is installed and `router` is set; with `base`, `models` are
    LoRA adapters of `base`, and one engine (and router) serves them all, each under its agent's
    name. Each process is appended to `services` as soon as it runs, so the caller stops it
    whatever fails next. Returns the coordinator, the engines' URLs, the URLs the agents are
    reached at, and whether routers are in front."""
    from mrlx_plugin.local.services import router_available, start_coordinator, start_engine, start_router

    coordinator = start_coordinator(
        out / "coordinator.sqlite",
        run_id,
        list(models),
        log_dir=out / "logs",
        token_env="MRLX_DEMO_TOKEN",
        env={"MRLX_DEMO_TOKEN": token},
    )
    services.append(coordinator)
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
        services.append(engine)
        url = engine.url
        if use_router:
            front = start_router([engine.url], log_dir=out / "logs", name=f"router-{label}")
            services.append(front)
            url = front.url
        for name in models if base is not None else [label]:
            engines[name], urls[name] = engine.url, url
    return coordinator, engines, urls, use_router


def tools_system_text(model_dir: Path, tools: list[dict]) -> str:
    """The system message that renders exactly as the model's chat template renders `tools`.

    The trainer's supervised warm-start renders its examples without tools; an example that opens
    with this system message is then the very prompt an episode shows."""
    from mrlx_plugin.core.config import ConfigError
    from mrlx_plugin.local.model import IM_END, IM_START, load_tokenizer

    tok = load_tokenizer(model_dir)
    probe = [{"role": "user", "content": "?"}]
    plain = tok.apply_chat_template(probe, tokenize=False)
    with_tools = tok.apply_chat_template(probe, tools=tools, tokenize=False)
    head, opening, closing = with_tools[: len(with_tools) - len(plain)], f"{IM_START}system\n", f"{IM_END}\n"
    text = head[len(opening) : -len(closing)]
    if not (
        with_tools.endswith(plain)
        and head.startswith(opening)
        and head.endswith(closing)
        and tok.apply_chat_template([{"role": "system", "content": text}, *probe], tokenize=False)
        == with_tools
    ):
        raise ConfigError(
            f"the chat template of {model_dir} does not render tools as one system block before the "
            "messages (a model built before tool support?); remove that directory or give another --out"
        )
    return text


def rl_settings(lr: float) -> dict[str, float | str]:
    """The agent-code demos' `mrlx.trainer` RL settings (docs/local.md), which a small model learns
    with: a short warm-up of the rate, then cosine to a tenth of it, a KL term, two PPO epochs."""
    return {
        "lr": lr,
        "lr_warmup_steps": 5,
        "lr_decay_style": "cosine",
        "lr_min": lr / 10,
        "kl_coef": 0.1,
        "ppo_epochs": 2,
        "adam_eps": 1.0e-5,
    }


def trainer_flags(ns: argparse.Namespace, prompts: Path, max_response: int) -> list[str]:
    """The trainer flags of every demo: its steps and prompts, the episodes of a step (--steps,
    --prompts-per-step, --samples-per-prompt), the length of a response."""
    return [
        "--num-rollout",
        str(ns.steps),
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        str(ns.prompts_per_step),
        "--n-samples-per-prompt",
        str(ns.samples_per_prompt),
        "--rollout-max-response-len",
        str(max_response),
    ]


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


def latest_checkpoint(agent_dir: Path) -> Path | None:
    """The newest complete checkpoint in an agent's folder of a run, or None."""
    found = sorted(p for p in (agent_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    return found[-1] if found else None


def _peak_memory_kib(pid: int) -> int:
    """The peak resident memory of process `pid` so far (0 once it has exited)."""
    try:
        return int(memory_mib(pid)[1] * 1024)
    except OSError:  # it has exited
        return 0


class Running:
    """The processes of a demo run: its services (engines, routers, the coordinator) and its
    trainers, by agent. The `with` block that holds it stops them all when it ends, however it
    ends (an exception, or a signal: see `mrlx_plugin.cli.main`), the trainers first: they use
    the services."""

    def __init__(self) -> None:
        self.services: list[ManagedProcess] = []
        self.trainers: dict[str, subprocess.Popen] = {}
        self._peak_kib: dict[int, int] = {}

    def __enter__(self) -> Running:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        from mrlx_plugin.core.processes import stop_all

        stop_all(self.trainers.values(), timeout=20)
        stop_all([p.proc for p in self.services], timeout=10)

    def finished(self) -> bool:
        """Every trainer has exited, or one has failed (the others would wait for it for ever)."""
        codes = [job.poll() for job in self.trainers.values()]
        return all(c is not None for c in codes) or any(c not in (None, 0) for c in codes)

    def follow(self, show: Callable[[bool], None], every_s: float = 0.5) -> None:
        """Until the trainers have `finished`, every `every_s`: the peak memory of every process,
        then `show(done)`, which prints what is new in the metrics (`done`: this is the last call,
        the trainers have finished)."""
        while True:
            done = self.finished()
            pids = [j.pid for j in self.trainers.values()] + [p.proc.pid for p in self.services]
            for pid in pids:
                self._peak_kib[pid] = max(self._peak_kib.get(pid, 0), _peak_memory_kib(pid))
            show(done)
            if done:
                return
            time.sleep(every_s)

    def check(self, out: Path) -> None:
        """RuntimeError with the log's tail for a trainer that exited with an error."""
        for name, job in self.trainers.items():
            if job.returncode != 0:
                tail = (out / "logs" / f"trainer-{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the trainer of {name} failed (exit {job.returncode}):\n{tail}")

    def peak_memory_mib(self) -> float:
        """The peak memory of the run: every process it followed, and the demo's own."""
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return (sum(self._peak_kib.values()) + own) / 1024


# ----------------------------------------------------------------------------------------------
# The report
# ----------------------------------------------------------------------------------------------


def fmt(v: object) -> str:
    """A measure in a progress line or table: three decimals, or "-" when there is none."""
    return f"{v:.3f}" if isinstance(v, float) else "-"


def write_report(out: Path, summary: JSONObject, rows: object) -> JSONObject:
    """`summary` and every metrics row in OUT/metrics.json; the summary names the file."""
    (out / "metrics.json").write_text(
        json.dumps({"summary": summary, "metrics": rows}, indent=1, default=str)
    )
    summary["metrics"] = str(out / "metrics.json")
    return summary


def save_plot(
    out: Path,
    draw: Callable[[Axes], None],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    ylim: tuple[float, float],
    legend: dict[str, object],
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


def held_out_summary(prompts: int, evals: list[JSONObject]) -> JSONObject:
    """A summary's held-out evaluations: before RL (the first), after it (the last), the curve."""
    return {
        "prompts": prompts,
        "before": evals[0] if evals else None,
        "after": evals[-1] if len(evals) > 1 else None,
        "curve": evals,
    }


def print_measures(s: JSONObject, columns: list[tuple[str, str, int]], label_width: int) -> None:
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


def print_files(s: JSONObject, checkpoints: list[str]) -> None:
    """Where a demo left its plot, its metrics and its checkpoints."""
    print(f"  plot: {s['plot']}\n  metrics: {s['metrics']}\n  checkpoints: {', '.join(checkpoints)}")
