"""Do partial rollouts learn as sync does? Greedy test accuracy of ``trainer.mode = "partial"`` against ``"sync"``
on the built-in task (issue 33, part 3: "a learning curve on the built-in task within noise of sync").

Runs the README's default run (``verl run`` with no arguments: the built-in tiny Qwen2 on two-digit addition, GRPO,
64 prompts x 8 samples a step) in ``trainer.mode = "sync"`` and ``trainer.mode = "partial"`` with
``trainer.token_budget = --budget``, the same seeds, alternated in fresh processes (seed by seed, sync first), for
``--steps`` steps each, validating greedily every ``--val-every`` steps (``val/reward_mean`` on the 500 held-out
sums). The runs go through :func:`async_curves.run`, the launcher of ``bench/async_curves.py``.

The budget has to split this task's responses for the comparison to mean anything. A response is the sum's digits
and ``<eos>``: 3 tokens for sums under 100 (40% of the prompts), 4 for the rest (``rollout.max_new_tokens = 4``).
At a budget of 3, the 2-digit answers end in their first round and the 3-digit ones hit the budget with their
digits and no ``<eos>``: a group with one of those is unfinished, a new batch joins the pool, and the step trains
once ``data.batch_size`` groups have finished, carrying the rest into the next step, where they end on the new
weights (stale tokens, importance-weighted: the mode's defaults, old log-probs recomputed and
``algorithm.rollout_is_cap = 2.0``). A budget of 2 carries nothing: in the first round no group finishes, so no new
batch joins, and the second round finishes them all. Measured in 2-step runs (seed 1): budget 3 trained 85% stale
tokens at step 2 (287 samples a step carried into the next), budget 2 none, budget 1 29%. How many samples were carried and resumed
is read from the metrics the partial mode logs (``partial/resumed_samples``: trained samples with tokens of more
than one round; ``partial/stale_token_frac``; ``partial/staleness``) and reported.

"Within noise" is judged against the seed-to-seed spread: the paired difference (partial - sync, same seed) of the
final and of the best greedy accuracy, against the range over seeds of each mode. Writes
``bench/results/partial_learning.{json,md,png}`` (``--results STEM`` elsewhere)::

    python bench/partial_learning.py [--steps 100] [--seeds 1,2] [--budget 3] [--lock /tmp/verl-heavy.lock]
                                     [--results STEM] [--report-only] [extra verl run overrides...]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))
import async_curves as ac  # noqa: E402 - bench/async_curves.py: the launcher, the smoothing, samples per step
from machine import cpu_name  # noqa: E402

MODES = ("sync", "partial")
#: Per-step metrics of the partial mode kept in the results (see verl_trainer_async.partial).
PARTIAL_METRICS = ("partial/resumed_samples", "partial/carried_samples", "partial/stale_token_frac",
                   "partial/staleness", "partial/rounds")


def overrides_of(mode: str, budget: int, val_every: int) -> list[str]:
    own = [f"trainer.mode='{mode}'"] + ([f"trainer.token_budget={budget}"] if mode == "partial" else [])
    return [*own, f"run.val_every={val_every}"]


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def _follow(out: Path, label: str, steps: int, stop: threading.Event) -> None:
    """Prints a run's validations and every tenth step while it runs (the launcher waits for the process)."""
    seen, finished = 0, False
    while not finished:
        finished = stop.wait(5.0)  # one more pass once the run has ended, for its last rows
        try:
            rows = _rows(out)
        except json.JSONDecodeError:  # a line being written
            continue
        for r in rows[seen:]:
            if "val/reward_mean" in r:
                print(f"    {label}: step {int(r['step'])}/{steps} val {r['val/reward_mean']:.3f}", flush=True)
            elif "reward/mean" in r and int(r["step"]) % 10 == 0:
                carried = (f", resumed samples {r['partial/resumed_samples']:.0f}"
                           if "partial/resumed_samples" in r else "")
                print(f"    {label}: step {int(r['step'])}/{steps} train reward {r['reward/mean']:.3f}, "
                      f"{r.get('timing/step', float('nan')):.2f} s/step{carried}", flush=True)
        seen = len(rows)


def one_run(mode: str, seed: int, args: argparse.Namespace, extra: list[str], out: Path) -> dict:
    stop = threading.Event()
    follower = threading.Thread(target=_follow, args=(out, f"{mode} seed {seed}", args.steps, stop), daemon=True)
    follower.start()
    try:
        result = ac.run(mode, seed, args.steps, args.lock, extra, out,
                        overrides=overrides_of(mode, args.budget, args.val_every))
    finally:
        stop.set()
        follower.join()
    if "val" in result:
        if mode == "partial":
            rows = _rows(out)
            result["partial"] = {k: {int(r["step"]): r[k] for r in rows if k in r} for k in PARTIAL_METRICS}
        result["samples_per_step"] = ac._samples_per_step((out / "config.toml").read_text())
    return result


def _final(r: dict) -> float:
    return r["val"][max(r["val"], key=int)]


def _best(r: dict) -> float:
    return max(r["val"].values())


def _carry_summary(r: dict) -> str:
    p = r["partial"]
    resumed = sum(p["partial/resumed_samples"].values())
    trained = len(p["partial/resumed_samples"]) * r["samples_per_step"]
    return (f"{resumed:.0f} of {trained} trained samples resumed, i.e. generated over more than one round "
            f"({resumed / max(1, trained):.1%}); "
            f"{statistics.fmean(p['partial/stale_token_frac'].values()):.1%} of trained tokens stale on average; "
            f"staleness up to {max(p['partial/staleness'].values()):.0f}; "
            f"{statistics.fmean(p['partial/rounds'].values()):.2f} rounds a step; "
            f"{statistics.fmean(p['partial/carried_samples'].values()):.0f} samples carried into the next step on "
            f"average")


def _span(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def reading(by_seed: dict[int, dict[str, dict]]) -> list[str]:
    """The paired differences and whether they are within the seed-to-seed spread (see the module)."""
    paired = {s: m for s, m in by_seed.items() if all(k in m for k in MODES)}
    if not paired:
        return ["No seed has both modes: nothing to compare."]
    lines, within = [], []
    for name, of in (("final", _final), ("best", _best)):
        diffs = [of(m["partial"]) - of(m["sync"]) for m in paired.values()]
        mean = statistics.fmean(diffs)
        spreads = {k: [of(m[k]) for m in paired.values()] for k in MODES}
        noise = max(max(v) - min(v) for v in spreads.values())
        if len(paired) < 2:
            verdict = "one seed only: no seed-to-seed spread to judge it against"
        else:
            within.append(abs(mean) <= noise)
            verdict = (f"seed-to-seed range {noise:.3f} (the wider of the two modes'): "
                       f"{'within' if within[-1] else 'not within'} the noise")
        lines.append(f"- {name} greedy accuracy, partial - sync, paired by seed: {mean:+.3f} "
                     f"({', '.join(f'{d:+.3f}' for d in diffs)}); sync {_span(spreads['sync'])}, partial "
                     f"{_span(spreads['partial'])} over seeds; {verdict}.")
    if within:
        lines += ["", f"Partial rollouts {'learn within' if all(within) else 'do not learn within'} the seed-to-seed "
                      f"noise of sync on this task ({len(paired)} seeds: a coarse estimate of the noise; "
                      f"`bench/results/async_curves.md` has sync's spread over 3 seeds)."]
    return lines


def report(state: dict, stem: Path) -> str:
    runs = [r for r in state["runs"] if "val" in r]
    by_seed: dict[int, dict[str, dict]] = {}
    for r in runs:
        by_seed.setdefault(r["seed"], {})[r["mode"]] = r
    lines = ["# Partial rollouts vs sync: learning curves on the built-in task (issue 33, part 3)", "",
             f"The README's default run (`verl run`: built-in tiny Qwen2, two-digit addition, GRPO, "
             f"{state.get('samples_per_step', '?')} samples a step, `rollout.max_new_tokens = 4`), "
             f"`trainer.mode='sync'` vs `trainer.mode='partial'` with `trainer.token_budget={state['budget']}` "
             f"(its defaults: old log-probs recomputed, `algorithm.rollout_is_cap = 2.0` on the stale tokens) "
             f"(responses: the sum's digits and `<eos>`, 3 tokens for sums under 100, 4 for the rest), "
             f"{state['steps']} steps, greedy validation every {state['val_every']} steps, "
             f"seeds {sorted(by_seed)}, alternated in fresh processes. CPU: {state['cpu']}. Command: "
             f"`{state['command']}`; date {state['date']}.", ""]
    if runs:
        steps = sorted({int(s) for r in runs for s in r["val"]})
        lines += ["Greedy test accuracy (`val/reward_mean`) by step:", "",
                  "| seed | mode | " + " | ".join(f"step {s}" for s in steps) + " | median s/step | wall s |",
                  "|---|---|" + "---|" * (len(steps) + 2)]
        for seed in sorted(by_seed):
            for mode in MODES:
                r = by_seed[seed].get(mode)
                if r:
                    val = {int(s): v for s, v in r["val"].items()}
                    lines.append(f"| {seed} | {mode} | " + " | ".join(
                        f"{val[s]:.3f}" if s in val else "-" for s in steps)
                        + f" | {r['median_step_s']:.2f} | {r['wall_s']:.0f} |")
        lines += ["", "| seed | sync final | partial final | difference | sync best | partial best | difference |",
                  "|---|---|---|---|---|---|---|"]
        for seed, m in sorted(by_seed.items()):
            if all(k in m for k in MODES):
                s, p = m["sync"], m["partial"]
                lines.append(f"| {seed} | {_final(s):.3f} | {_final(p):.3f} | {_final(p) - _final(s):+.3f} | "
                             f"{_best(s):.3f} | {_best(p):.3f} | {_best(p) - _best(s):+.3f} |")
        lines += ["", "Samples carried over by the partial runs (from `partial/*` metrics):", ""]
        lines += [f"- seed {seed}: {_carry_summary(m['partial'])}." for seed, m in sorted(by_seed.items())
                  if "partial" in m]
        lines += ["", "## Reading", "", *reading(by_seed)]
    errors = [r for r in state["runs"] if "error" in r]
    lines += [f"\nError, {r['mode']} seed {r['seed']}:\n\n```\n{r['error'][-1500:]}\n```" for r in errors]
    lines += ["", f"Raw data: `{stem.name}.json`; plot: `{stem.name}.png` (test accuracy per seed and mode, and the "
                  f"training reward smoothed over 10 steps)."]
    text = "\n".join(lines) + "\n"
    stem.with_suffix(".md").write_text(text)
    _plot(runs, state, stem)
    return text


def _plot(runs: list[dict], state: dict, stem: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"sync": "tab:blue", "partial": "tab:red"}
    styles = ["-", "--", ":", "-."]
    seeds = sorted({r["seed"] for r in runs})
    for r in runs:
        style = styles[seeds.index(r["seed"]) % len(styles)]
        vs = sorted(r["val"], key=int)
        a.plot([int(s) for s in vs], [r["val"][s] for s in vs], style, marker="o", markersize=3,
               color=colours[r["mode"]], label=f"{r['mode']} seed {r['seed']}")
        ts = sorted(r["train"], key=int)
        b.plot([int(s) for s in ts], ac.smooth([r["train"][s] for s in ts]), style, color=colours[r["mode"]])
    a.set(xlabel="step", ylabel="val/reward_mean (greedy)", title="test accuracy")
    b.set(xlabel="step", ylabel="reward/mean (10-step mean)", title="training reward")
    a.legend(fontsize=7)
    fig.suptitle(f"partial (token_budget={state['budget']}) vs sync, built-in task", fontsize=10)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps per run (the default run's 100)")
    ap.add_argument("--seeds", default="1,2", help="comma-separated run.seed values; each runs both modes")
    ap.add_argument("--budget", type=int, default=3, help="partial's trainer.token_budget (responses: 3-4 tokens)")
    ap.add_argument("--val-every", type=int, default=10, help="run.val_every: greedy validations along the curve")
    ap.add_argument("--lock", default="", help="flock file taken by each run while it computes")
    ap.add_argument("--results", default=str(RESULTS / "partial_learning"),
                    help="path stem of the results: STEM.json, STEM.md, STEM.png")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report and plot from STEM.json")
    args, extra = ap.parse_known_args()
    stem = Path(args.results)
    stem = stem.with_name(stem.name.removesuffix(".json"))
    if args.report_only:
        print(report(json.loads(stem.with_suffix(".json").read_text()), stem))
        return
    state = {"steps": args.steps, "budget": args.budget, "val_every": args.val_every, "cpu": cpu_name(),
             "date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
             "command": "python bench/partial_learning.py " + " ".join(sys.argv[1:]), "runs": []}
    seeds = [int(s) for s in args.seeds.split(",")]
    plan = [(seed, mode) for seed in seeds for mode in MODES]  # alternated, so that machine drift hits both
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (seed, mode) in enumerate(plan):
            elapsed = time.perf_counter() - started
            eta = f", about {elapsed / i * (len(plan) - i) / 60:.0f} min left" if i else ""
            print(f"[{i + 1}/{len(plan)}] {mode} seed {seed}: {args.steps} steps ({elapsed / 60:.1f} min in{eta})",
                  flush=True)
            result = one_run(mode, seed, args, extra, Path(tmp) / f"{mode}-{seed}")
            state["runs"].append(result)
            if "val" in result:
                state.setdefault("samples_per_step", result["samples_per_step"])
                done = (f"val {result['val'][min(result['val'], key=int)]:.3f} -> {_final(result):.3f} "
                        f"(best {_best(result):.3f}), {result['wall_s']:.0f} s, median {result['median_step_s']:.2f}"
                        f" s/step")
                if mode == "partial":
                    done += "; " + _carry_summary(result)
            else:
                done = "FAILED: " + result["error"][-800:]
            print(f"[{i + 1}/{len(plan)}] {mode} seed {seed}: {done}", flush=True)
            stem.parent.mkdir(parents=True, exist_ok=True)
            stem.with_suffix(".json").write_text(json.dumps(state, indent=1))
    print(report(state, stem))


if __name__ == "__main__":
    main()
