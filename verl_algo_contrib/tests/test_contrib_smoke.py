"""Every contributed algorithm runs a few steps of the built-in task through the real `verl run`.

The RL algorithms train on ``builtin:addition``; the offline preference algorithms train on pairs
derived from it (:func:`verl_algo_contrib.data.write_addition_preferences`) and validate on the
task's test split. Each run must finish, write its metrics for every step, validate before and
after, and report a metric only that algorithm's own code produces - proof it was really used.
"""

from __future__ import annotations

import json
import math

import pytest

from verl_algo_contrib.data import write_addition_preferences

# Small but real: the default model, backend and rollout, fewer prompts.
FAST = ["--max-steps", "2", "data.batch_size=8", "rollout.n=4", "data.max_val_samples=16", "run.threads=1",
        "run.val_every=0"]

# name -> (extra arguments, a metric only that algorithm's code emits)
CASES = {
    # A budget of 8 tokens and a 3-token buffer switch DAPO's overlong shaping on.
    "dapo": (["rollout.max_new_tokens=8", "algorithm.overlong_buffer_len=3", "algorithm.max_extra_rounds=2"],
             "dapo/overlong_penalty_mean"),
    "gspo": ([], "ppo/seq_ratio_mean"),
    "rloo": ([], "ppo/pg_loss"),
    "reinforce_pp": ([], "ppo/kl_in_reward"),
    "reinforce_pp_baseline": ([], "ppo/kl_loss"),
    "remax": ([], "baseline/greedy_reward_mean"),
    "drgrpo": ([], "ppo/pg_loss"),
    "cispo": ([], "ppo/is_weight_mean"),
    "gpg": ([], "ppo/pg_loss"),
    "opo": ([], "ppo/pg_loss"),
    "spin": ([], "spin/pairs"),
    "dpo": (["PAIRS"], "preference/accuracy"),
    "kto": (["UNARY"], "kto/kl_reference"),
    "orpo": (["PAIRS"], "orpo/nll"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_algorithm_runs_through_the_cli(name, tmp_path, run_verl):
    extra, own_metric = CASES[name]
    if extra and extra[0] in ("PAIRS", "UNARY"):
        data = write_addition_preferences(tmp_path / "prefs.jsonl", rows=64, unary=extra[0] == "UNARY")
        extra = ["--data", str(data), 'data.val="builtin:addition"']
    out = tmp_path / "run"
    res = run_verl("run", "--algo", name, "--output-dir", str(out), *FAST, *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f'name = "{name}"' in (out / "config.toml").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "ppo/actor_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert math.isfinite(r["ppo/actor_loss"]), r
        assert own_metric in r, f"{own_metric} missing: {sorted(r)}"
    val = [r for r in rows if "val/reward_mean" in r]
    assert [r["step"] for r in val] == [0, 2]
    assert 0.0 <= val[-1]["val/reward_mean"] <= 1.0
