"""Budgets that hold the core's shape: its size, and what code outside it may import.

Growth past a budget is a decision made in a commit that changes the number here, with its reason,
never drift. The Core v3 targets (issue #29) are written beside the numbers in force: the core at
4,500 lines and a public surface of at most 8 modules. The numbers in force are what the core holds
today; each move of an implementation out of the core lowers them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import verl_core

CORE = Path(verl_core.__file__).parent
REPO = CORE.parents[2]

#: Lines of ``verl_core/src`` without ``testing/``: 8,550 when issue #29 was filed, 10,786 on 2026-12-04
#: after wave 3's trust work landed in the core (boundary checks 205, run directory 375, the run's model
#: copy 215, the dry run 351, config import 472, the step context 60). Target of issue #29: 4,500, by
#: moving implementations out (the HF rollout, the algorithms, the agent loop, loggers, data readers, the
#: async producer, config import); each move lowers this number in the commit that makes it. 10,850:
#: the whole suite's fixes of that day (Executor.is_controller for torchrun ranks, the start-over rule of a
#: run directory without a checkpoint, shared by the dry run). 10,666: the HF rollout moved to
#: verl-rollout-hf (-185 lines; precision.py's autocast helpers folded into sharding.py, -1 module).
#: 10,116: GRPO, PPO and their loss math moved to verl-algorithms (-550 lines: -619 moved, +72 for the
#: three tensor helpers the core's own nodes use, now in batch.py: masked_mean, scores_to_token_rewards,
#: kl_penalty; -4 re-exports of the algorithms in verl_core/__init__.py, +1 install hint).
#: 8,647: config import moved to verl-config-import (-424 lines: -472 moved, +23 for the ConfigFormat
#: contract, +23 for the CLI's lookup of config formats and its install hint, +2 for the registry's
#: config_format kind); measured with moves not yet counted above (the agent loop, the loggers) in the tree.
#: 8,647: the console and jsonl loggers moved to verl-loggers (-221 lines, nothing left in the core; already
#: out of the tree when the 8,647 above was measured).
#: 8,646: the multi-turn agent loop moved to verl-env-kit (-286 lines: -311 moved, +23 in interfaces.py for
#: the Environment.run_episodes contract the core calls and the ENV_REWARDS key it reads, +2 at its two call
#: sites; already out of the tree when the 8,647s above were measured; the -1 is rollout_stage's imports).
#: Also inside the 8,647s and 8,646 above: the async producer, its replay buffer and engine host moved to
#: verl-trainer-async behind the step-source contract (verl_core.contracts.StepSource; the core keeps the
#: sync source), and the trainer's validation, assembly and checkpoint contents got modules of their own:
#: -521 lines in all (-582 moved, the trainer's mode branches gone, +190 for the contract and the sync source).
#: 8,814, raised on purpose: the contracts left interfaces.py for one module per plugin kind in
#: verl_core.contracts (+115 lines: each module's docstring and imports), and verl_core.kit re-exports
#: the shared helpers plugins may use (+53), so that code outside the core imports 6 modules, not 19.
#: 8,859: the Trainer split to its 300-line limit and data.render_rows to 80 (OVER_SIZE is empty): +45 for
#: the signatures and docstrings of the functions they became (assembly.open_model, load_prompts,
#: make_backend; run_state.saved_config, restart, at_step; samples.step_report; data._fitted_rows).
#: 8,886: TrainingBackend.roles, the roles a backend builds workers for, checked at assembly (and by the dry
#: run) instead of a NotImplementedError mid-run (+27: the check and its message).
#: 8,957: generated data, data.train = "<provider>:<argument>" (reasoning_gym:chain_sum; DatasetProvider.argument
#: and from_spec, data.size / data.val_size, checked with the data sources before anything loads) (+72, #32).
#: 8,970: an unknown plugin in a config section names its key ("trainer.mode: no step_source plugin named
#: 'x'...", "algorithm.name: ..."), as every other config error does (+13).
#: 8,363: the shared engine/backend/executor helpers moved to the verl-kit library (-607 lines: sharding.py 271,
#: engine_kit.py 195, builtin_kit.py 86, the model side of multimodal.py 56, their kit.py re-exports 4; +5 net
#: for ServerError, which the CLI reports, now in verl_core.contracts).
#: 7,772: the data readers moved to verl-data behind the DataReader contract (verl_core.contracts.data,
#: data.reader, entry points verl.data_readers) (-591 lines: -742 moved, data.py 563 and the data side of
#: multimodal.py 179; +45 for the contract and DataError, +53 for the prompt sampler the core keeps
#: (sampler.py), +30 for the boundary check of every row a reader returns, +16 in assembly for the reader's
#: lookup and the vocabulary both checks use, +5 for data.reader and HUB_ID in config.py, +2 for the kind).
#: +1 (2026-12-04): the install hint names verl-env-openenv (its openenv environment), code_tests and auto.
#: 7,536: health and samples became verl-loggers' hook plugins and Progress moved to verl-kit (-237 lines:
#: -291 moved, health.py 77, samples.py 120, progress.py 94; +49 in hooks.py for the sample records the
#: validation hands to verl_validation_end and the new verl_step_batch spec, +8 for rollout_utils.run_guard_limit
#: the health plugin reads, -3 net in the trainer, validation, assembly and kit).
#: 6,946: the command-line front end moved to verl-cli (-590 lines: cli.py 396, the dry-run report 326 and
#: export.py 45 moved; +177 for verl_core.api, the run API it calls instead of the core's internals: check,
#: the dry run's checks that walk the trainer's set-up, saved_run for export, the errors a run stops with).
#: 6,949: +1 install hint (verl-env-verifiers in KNOWN_DISTRIBUTIONS), +2 for Environment.task_for(section):
#: a task that follows the [environment] settings (--env verifiers: environment.id picks the data).
#: 6,953: +3 in the boundary check of a StepResult: info["rewards"], the reward's named parts the agent loop
#: logs as reward/<name> (verifiers' rubric parts), must be a dict of names to real numbers; +1 docstring.
#: 6,955: DataflowBuilder.actor_log_probs(reuse=False): an algorithm can force the old-log-prob forward
#: (algorithm.old_log_probs = "recompute", #33) where the skip would otherwise apply; +1 docstring.
#: 6,970: executor.device for the default in-process executor ("auto": CUDA where torch sees a device; +15:
#: ExecutorConfig.device and its check, the executor putting its worker there). Until then a one-GPU
#: machine's `verl run` trained on the CPU without saying so; a device no one has is refused before any
#: model loads (exit 2).
#: 6,088: the run directory moved to verl-run-store behind the RunStore contract (verl_core.contracts.run_store,
#: run.store, entry points verl.run_stores) (-882 lines: -987 moved, checkpoint.py 360, rundir.py 407, run_model.py
#: 220; +113 for the contract and the checkpoint errors the core raises and catches, now in it; -8 net at the call
#: sites in the trainer, run_state, assembly, api and kit, which now ask the store, run.store and its check included).
#: 6,105 (+17), the review of that move: a run resumes and exports only through the store it recorded
#: (from_checkpoint(store=), saved_config and saved_run refuse another, +8), the kit names that left say where they
#: went (+6), and the contract says a remote store stages its checkpoints locally (+3).
#: 6,110 (+5): run_state.copy_overrides, the one place that turns the store's model copies into ``model.*``
#: overrides (resume and export each formatted them; run_model.copy_overrides did it once before the move).
#: 6,051: the PPO family's KL-in-reward left the core for verl-algorithms (-59: DataflowBuilder.kl_in_reward and its
#: node, kl_penalty and the KL estimator names; PolicyGradient declares the same ``kl_reward`` node itself).
#: 6,039: the table of pre-Core-v2 PPO defaults (rollout_is_cap and the rest) left the core for verl-algorithms
#: (-12: -22 moved; +6 for the Algorithm.saved_settings hook a resume calls, +4 at its call in run_state).
#: 6,023: Executor.trainer_mode_problem, which named the async modes, left the executor contract (-16): the
#: async source asks an executor that defines it (Ray) and has the in-process default itself.
#: 5,951: what the training backends share about cutting a batch moved to verl-kit's training module (-72:
#: rank_mini_batch, check_sequence_length, micro_batch_weights from the backend contract, Batch.token_groups and
#: Batch.trim_padding, which only the backends called).
#: 5,843 (-108): contracts/__init__.py lists each public name once, in its module's __all__ (-33);
#: CorruptCheckpointError, which only verl-run-store raises, is its own (-9); config.field_docs went to the CLI, its
#: only user, set_key was inlined there, and three copies of "layer defaults under the user's settings" became one
#: (-48); the dry run's check calls the trainer's load_prompts and make_backend instead of repeating them (-18).
#: 5,829 (-14): validation builds its batches with the rollout stage's generate_batch and decodes one way for both
#: paths (its samples files are byte-identical on the default run), and dead code went (ON_INVALID, sample_records'
#: unused indices, the one-line Trainer._restart_workers).
#: 5,833 (+4), review of the moves above: a v2 plugin's refusal names where each moved helper went (+3), and the kit's
#: docstring names verl_kit.training (+1).
#: 5,771: the in-process executor, an implementation of the executor contract, moved to verl-executor-local
#: (-62: executor_local.py -63, +1 install hint); executor.name = "local" stays the default.
#: 5,772 (+1): Range compares with the operator module (an int value against a fractional bound was refused).
#: 5,783 (+11): the rollout stage checks that an environment's episode batch records its response budget
#: (boundary.check_response_budget): Dr. GRPO's loss divides by it, and without it divided by each micro-batch's width.
#: 5,784 (+1): the kit exports generate_batch and check_log_prob_gap, with which the overlapping step sources check
#: their producer's engine after each weight sync (their batches come from older weights, which no step check sees).
#: 5,792 (+8): validation samples with its own top_p/top_k (val_top_p, val_top_k, verl's val_kwargs; the training
#: top_p applied to neither), and val_n > 1 with greedy validation is refused (it averaged val_n copies of one sample).
#: 5,777 (-15): validation generates through the rollout stage's generate (one path for both, and an environment's
#: validation episodes get the response-budget check too); the dataflow's levels come from graphlib (standard
#: library) instead of a hand-written depth search; the reward model's worker factory is the one of every role.
#: 5,780 (+3), review of the validation sampling: val_top_p/val_top_k with greedy validation are refused, not unused.
#: 5,782 (+2): a float setting of NaN is a config error naming its key (it passed every range check, and a NaN
#: entropy_coef loaded the model and stopped at step 1 blaming the learning rate).
#: 5,784 (+2): verl export resolves only the [run], [model] and [backend] it builds the actor from, so a setting a
#: later release refuses elsewhere (greedy validation with val_n > 1) no longer locks a recorded run's weights in.
#: 5,786 (+2): a float setting of inf is a config error too (it passed every range without an upper bound: a
#: temperature of inf sampled uniformly and trained on it, a kl_coef or lr of inf stopped at step 1 on a NaN loss).
#: 5,787 (+1): lengths fitted to a deleted model come from its copy in the default run directory too (only a given
#: run.output_dir was looked in; the same command run again then resumed with 512 + 64 tokens against 48 + 16).
#: 5,788 (+1), review: a ``float | None`` setting of inf says "expected a finite number", its float's own reason,
#: not "expected float | None, got inf" (the one-type union passes on its type's error).
#: 5,793 (+5): settings read as something else are refused: backend.grad_clip < 0 (no clipping), weight_decay < 0,
#: log_prob_micro_batch_size and logits_chunk_size < 1 (read as 1: a forward per sample or token),
#: data.val_batch_size < 0 (validated nothing) and data.max_val_samples < 0 (dropped the last prompt).
CORE_LINE_BUDGET = 5_793

#: The ``verl_core`` modules that code outside the core (every distribution's ``src``, the ``verl``
#: facade) imports today. Target of issue #29: at most 8 (the contracts, Batch, config types, the
#: registry helpers and a kit of shared helpers). A plugin importing a module not listed here fails
#: this test: make what it needs public in a listed module, or add the module here in a commit that
#: says why.
PUBLIC_SURFACE = {
    "verl_core", "verl_core.contracts", "verl_core.batch", "verl_core.config", "verl_core.registry",
    # The shared helpers, re-exported name by name from the modules that hold them (issue #29's "kit").
    "verl_core.kit",
    # The run API of a front end (verl-cli's `verl` command): the dry run's checks, a checkpoint opened with
    # its config for export, the errors a started run stops with; without it the CLI would reach into the
    # trainer, assembly, run directory and checkpoint modules.
    "verl_core.api",
}

#: Size limits in the core (``verl_core/src`` without ``testing/``), in lines from a definition's ``def`` or
#: ``class`` line to its last: a class at most 300, a function or method (nested ones too) at most 80, so the
#: RL step and each part of it read in a screen or two.
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80

#: What is over those limits today, at its size today (``file:Qualified.name``). This list only shrinks;
#: issue #29's target is an empty one. A new entry fails the test, and so does a listed one that grows; so
#: does one no longer over its limit, or gone, so that the list stays current: delete its line here.
OVER_SIZE: dict[str, int] = {}  # was Trainer 390 and data.render_rows 94 when the check came in


def core_lines() -> int:
    return sum(len(p.read_text().splitlines()) for p in CORE.rglob("*.py")
               if "testing" not in p.relative_to(CORE).parts)


def outside_sources() -> list[Path]:
    """Every Python source of the repository's other distributions (not their tests) and the facade."""
    roots = [p for p in REPO.glob("verl_*/src") if p.parent.name != "verl_core"]
    roots += list(REPO.glob("plugins/*/src")) + [REPO / "verl"]
    return sorted(f for root in roots for f in root.rglob("*.py"))


def core_imports(path: Path) -> list[tuple[str, list[str], int]]:
    """``(module, names, line)`` of each import of ``verl_core`` in ``path`` (function-level ones too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "verl_core":
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "verl_core"]
    return found


def test_the_core_stays_within_its_line_budget():
    lines = core_lines()
    assert lines <= CORE_LINE_BUDGET, (
        f"verl_core/src holds {lines} lines (testing/ aside), over its budget of {CORE_LINE_BUDGET}: move an "
        f"implementation into a distribution of its own, or raise CORE_LINE_BUDGET in a commit that says why")


def test_code_outside_the_core_imports_only_the_public_surface_and_no_private_name():
    assert outside_sources(), "found no distribution sources: the repository layout changed"
    problems = []
    for path in outside_sources():
        where = path.relative_to(REPO)
        for module, names, line in core_imports(path):
            private = [n for n in (module.split(".") + names) if n.startswith("_") and not n.startswith("__")]
            if private:
                problems.append(f"{where}:{line}: imports the private {private} from {module}")
            submodules = {f"{module}.{n}" for n in names} & {m for m in _core_modules()}
            for used in {module} | submodules:
                if used not in PUBLIC_SURFACE and used in _core_modules():
                    problems.append(f"{where}:{line}: imports {used}, which is not in the public surface")
    assert not problems, "\n".join(problems)


def _core_modules() -> set[str]:
    out = set()
    for p in CORE.rglob("*.py"):
        parts = list(p.relative_to(CORE.parent).with_suffix("").parts)
        out.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def oversized() -> dict[str, int]:
    """``{"file.py:Class.method": lines}`` of each class and function of the core over its size limit."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, where: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name, size = prefix + child.name, child.end_lineno - child.lineno + 1
                if size > (MAX_CLASS_LINES if isinstance(child, ast.ClassDef) else MAX_FUNCTION_LINES):
                    found[f"{where}:{name}"] = max(size, found.get(f"{where}:{name}", 0))  # a property's setter
                visit(child, where, name + ".")
            else:  # definitions under an if, a try, a with
                visit(child, where, prefix)

    for path in sorted(CORE.rglob("*.py")):
        if "testing" not in path.relative_to(CORE).parts:
            visit(ast.parse(path.read_text()), path.relative_to(CORE).as_posix(), "")
    return found


def test_no_class_or_function_of_the_core_grows_past_its_size_limit():
    found = oversized()
    problems = [f"{name}: {size} lines, over its limit (a class {MAX_CLASS_LINES}, a function {MAX_FUNCTION_LINES}): "
                f"split it" for name, size in found.items() if name not in OVER_SIZE]
    problems += [f"{name}: {found[name]} lines, grown from the {size} that OVER_SIZE allows: split it"
                 for name, size in OVER_SIZE.items() if found.get(name, 0) > size]
    problems += [f"{name}: no longer over its limit (gone or under it): delete its line from OVER_SIZE"
                 for name in OVER_SIZE if name not in found]
    assert not problems, "\n".join(problems)


def test_the_trainer_names_no_trainer_mode_and_no_producer():
    """Where batches come from is the step source's business (``trainer.mode`` names a plugin): the trainer's
    code and docs name no mode and no producer (issue #29)."""
    text = (CORE / "trainer.py").read_text()
    named = sorted({m.group(0) for m in re.finditer(r"sync_mode|colocate_async|separate_async|is_async|producer",
                                                    text)})
    assert not named, f"trainer.py names {named}: that belongs to a step source (verl_core.contracts.StepSource)"
