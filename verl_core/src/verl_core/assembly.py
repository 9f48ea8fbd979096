"""How a run is assembled: the model, tokenizer and critic it starts from, its data, its checks on plugin
output, each checked before any model loads. :class:`~verl_core.trainer.Trainer` (and the dry run, which
walks the same checks) call these with the trainer ``t`` whose parts they read and set."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
from pathlib import Path
from typing import Any

from verl_core.boundary import Boundary, check_prompt_rows, plugin_label
from verl_core.config import HUB_ID, Config, ConfigError, config_to_dict, plugin_for_key, resolve_config
from verl_core.contracts import DataReader, ModelSpec, Role, RunStore
from verl_core.registry import BUILTIN_PREFIX, PluginRegistry, load_builtin
from verl_core.rollout_utils import check_rollout_multi_modal
from verl_core.sampler import PromptSampler

__all__ = ["resolve_model_path", "check_model_source", "object_source", "OBJECT_PREFIX", "with_objects",
           "open_model", "load_prompts", "make_backend", "check_roles", "load_tokenizer", "pad_with_eos",
           "check_sources", "critic_spec", "check_step_source", "model_config", "make_boundary",
           "reusable_old_log_probs", "start_reward_model", "data_reader", "load_data", "vocab_size", "run_store"]


def _create_worker(backend: Any, role: Role, model: ModelSpec, seed: int, world: Any) -> Any:
    # Module level, not a closure: executors may pickle the factory (a partial of it) into worker processes.
    return backend.create_worker(role=role, model=model, world=world, seed=seed)


def resolve_model_path(path: str, registry: PluginRegistry | None = None) -> str:
    """Turn ``builtin:<name>`` into the local directory its ``verl.models`` plugin builds and caches."""
    if path.startswith(BUILTIN_PREFIX):
        return str(load_builtin(registry or PluginRegistry(), "model", path, key="model.path").model_dir())
    return path


#: How a run's config records a model, tokenizer or critic given to :class:`Trainer` as an object.
OBJECT_PREFIX = "<object: "


def object_source(obj: Any) -> str:
    """The config entry of an object given to :class:`Trainer`: ``"<object: Qwen2ForCausalLM from '/m/q'>"``."""
    origin = getattr(obj, "name_or_path", "")
    return f"{OBJECT_PREFIX}{type(obj).__name__}{f' from {origin!r}' if isinstance(origin, str) and origin else ''}>"


def check_model_source(path: str, key: str, *, need_config: bool = True, argument: str = "model") -> None:
    """Refuse a model (or tokenizer) path that cannot load, before anything does (:class:`ConfigError` on ``key``).

    A local path must be a directory, holding ``config.json`` when ``need_config``; a Hub id (``owner/name``)
    is left to ``from_pretrained`` where a network exists. An object's entry (:func:`object_source`) asks
    for the object again, as ``Trainer(..., argument=...)``.
    """
    if path.startswith(OBJECT_PREFIX):
        raise ConfigError(key, f"the run was given {path}, and a config or checkpoint cannot rebuild an object; pass "
                               f"it again: Trainer.from_checkpoint(run_dir, {argument}=...), or set {key} to a "
                               f"model directory")
    where = Path(path).expanduser()
    if where.is_dir():
        if need_config and not (where / "config.json").is_file():
            raise ConfigError(key, f"{path!r} has no config.json, so it is not a Hugging Face model directory "
                                   f"(save_pretrained writes one)")
    elif where.exists():
        raise ConfigError(key, f"{path!r} is a file; give a Hugging Face model directory (save_pretrained output)")
    elif path.startswith(("/", ".", "~")) or not HUB_ID.match(path):
        raise ConfigError(key, f"{path!r} does not exist; give a local Hugging Face model directory, a builtin: "
                               f"model such as builtin:tiny-qwen2-addition, or a Hub id (owner/name) where a "
                               f"network exists")


def with_objects(config: Config, registry: Any, *, model: Any, tokenizer: Any, critic: Any) -> Config:
    """The config re-resolved for objects: their entries recorded, the model's own defaults under the user's."""
    raw = json.loads(json.dumps(config.raw if config.raw is not None else config_to_dict(config)))
    section = raw.setdefault("model", {})
    for key, obj in (("path", model), ("tokenizer", tokenizer), ("critic_path", critic)):
        if obj is not None:
            section[key] = object_source(obj)
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return resolve_config(raw, registry, max_positions=positions)


def load_tokenizer(config: Config, path: str) -> tuple[Any, str | None]:
    """The run's tokenizer from ``path``, padding with its eos token when it has no pad token (then with a
    note saying so: padded positions are masked out, so this changes nothing learned)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.tokenizer" if config.model.tokenizer else "model.path",
                          f"cannot load a tokenizer from {path!r}: {exc}") from exc
    return tokenizer, pad_with_eos(tokenizer, path)


def pad_with_eos(tokenizer: Any, path: str) -> str | None:
    """Give a tokenizer without a pad token its eos token as one; the note to show, or None when it had one."""
    if tokenizer.pad_token_id is not None:
        return None
    if tokenizer.eos_token_id is None:
        raise ConfigError("model.tokenizer", f"the tokenizer at {path!r} has neither a pad nor an eos token")
    tokenizer.pad_token = tokenizer.eos_token
    return (f"the tokenizer at {path!r} has no pad token; padding with its eos token {tokenizer.eos_token!r} "
            f"(padded positions are masked out, so this changes nothing learned)")


def open_model(t: Any) -> tuple[str, str]:
    """The model and tokenizer paths of trainer ``t`` (a run directory's own copies stand in for missing ones),
    checked; its tokenizer loaded; on the controller, the run directory claimed (:meth:`RunStore.claim`: a
    resume with another model stops here, from metadata; the run's model copies written)."""
    cfg, store = t.config, t.store
    model_path = (store.stand_in("model.path", resolve_model_path(cfg.model.path, t.registry))
                  if t._model_obj is None else (cfg.model.path or ""))
    tok_path = store.stand_in("model.tokenizer", cfg.model.tokenizer) or model_path
    check_sources(t, model_path, tok_path)
    padded = pad_with_eos(t.tokenizer, tok_path) if t.tokenizer is not None else None
    if t.tokenizer is None:
        t.tokenizer, padded = load_tokenizer(cfg, tok_path)
    if padded:
        logging.getLogger(__name__).warning("%s", padded)
    if t.registry.load("executor", cfg.executor.name).is_controller(cfg.executor.config):
        store.claim(cfg, t.registry, model_path=model_path, model=t._model_obj, tokenizer=t.tokenizer,
                    critic=t._critic_obj)  # one run per directory, a resume only of what it holds
    return model_path, tok_path


def load_prompts(t: Any, needs: Any) -> None:
    """Trainer ``t``'s training and validation rows, its prompt sampler, its number of steps (``run.max_steps``,
    or ``run.epochs`` passes over the prompts, a short last batch dropped) and its scorer, which resolves every
    data_source's reward now: a missing one fails before any model loads."""
    cfg = t.config
    t.train_rows, t.val_rows = load_data(t, needs.data)  # the reader shows its progress (tokenizing takes a while)
    t.sampler = PromptSampler(len(t.train_rows), cfg.data.batch_size, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
    t.max_steps = (cfg.run.epochs * (len(t.train_rows) // cfg.data.batch_size) if cfg.run.epochs
                   else cfg.run.max_steps)
    t.reward = t.registry.load("scorer", cfg.reward.name)(
        config=cfg.reward.config, registry=t.registry, tokenizer=t.tokenizer,
        data_sources={r["data_source"] for r in (*t.train_rows, *t.val_rows)})


def make_backend(t: Any) -> Any:
    """The training backend of trainer ``t``; a cosine schedule's length follows the run's steps (on a copy of
    the settings, so the saved config still says "follow max_steps")."""
    config = t.config.backend.config
    if not config.total_training_steps:
        config = dataclasses.replace(config, total_training_steps=t.max_steps)
    backend = t.registry.load("backend", t.config.backend.name)
    check_roles(backend, t.config.backend.name, t.algorithm.requirements(), t.reward.reward_model_path())
    return backend(config)


def check_roles(backend: Any, name: str, needs: Any, reward_model: str | None) -> None:
    """Refuse a backend that builds no worker for a role the run needs (:class:`ConfigError` on ``backend.name``):
    the actor always, the critic and the reference as the algorithm ``needs``, the reward model for a scorer
    with one."""
    needed = {Role.ACTOR: "the policy", Role.CRITIC: "the algorithm" if needs.critic else "",
              Role.REFERENCE: "the algorithm's KL term" if needs.reference else "",
              Role.REWARD_MODEL: "reward.reward_model" if reward_model else ""}
    missing = [(role, why) for role, why in needed.items() if why and role not in backend.roles]
    if missing:
        role, why = missing[0]
        builds = ", ".join(sorted(r.value for r in backend.roles))
        raise ConfigError("backend.name", f"backend {name!r} builds no {role.value} worker, which {why} needs (it "
                                          f"builds: {builds}); use a backend that does, e.g. backend.name='fsdp'")


def check_sources(t: Any, model_path: str, tok_path: str) -> None:
    """Paths that cannot load fail here, naming their key, not later as a traceback from transformers."""
    cfg = t.config
    if t._model_obj is None:
        check_model_source(model_path, "model.path")
    elif t.tokenizer is None and not cfg.model.tokenizer:
        raise ConfigError("model.tokenizer", "a model given as an object needs its tokenizer: pass tokenizer= "
                                             "too, or set model.tokenizer to a tokenizer directory")
    if t.tokenizer is None and cfg.model.tokenizer:
        check_model_source(tok_path, "model.tokenizer", need_config=False, argument="tokenizer")
    reader = data_reader(t.registry, cfg.data.reader)
    for key, spec in (("data.train", cfg.data.train), ("data.val", cfg.data.val)):
        reader.check(spec, key, t.registry)


def critic_spec(t: Any, needed: bool) -> ModelSpec:
    """Where the critic starts: ``critic_model=`` or ``model.critic_path``, else the actor's model."""
    path = t.config.model.critic_path
    if t._critic_obj is None and not path:
        return t.model_spec
    if not needed:
        raise ConfigError("model.critic_path", f"algorithm {t.config.algorithm.name!r} trains no critic; "
                                               f"leave model.critic_path and critic_model= out, or use one "
                                               f"with a critic (ppo)")
    if t._critic_obj is None:
        path = t.store.stand_in("model.critic_path", resolve_model_path(path, t.registry))
        check_model_source(path, "model.critic_path", argument="critic_model")
    return dataclasses.replace(t.model_spec, path=path, module=t._critic_obj)


def check_step_source(t: Any, needs: Any) -> None:
    """Refuse a ``trainer.mode`` the algorithm or the executor cannot run (:class:`ConfigError`)."""
    cfg = t.config
    t.registry.load("step_source", cfg.trainer.name).check(
        cfg.trainer.config, mode=cfg.trainer.name, algorithm=cfg.algorithm.name,
        generates=t.dataflow.rollout_request is not None, off_policy=needs.off_policy,
        executor=t.registry.load("executor", cfg.executor.name), executor_config=cfg.executor.config)


def model_config(t: Any) -> dict[str, Any] | None:
    """The policy model's Hugging Face config as a dict (of the object, else its config.json); None unknown."""
    module = t.model_spec.module
    try:
        return (module.config.to_dict() if module is not None else
                json.loads((Path(t.model_spec.path) / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return None


def make_boundary(t: Any) -> Boundary:
    """The checks on what this run's plugins return, with their names (one per rollout engine)."""
    cfg, label = t.config, functools.partial(plugin_label, t.registry)
    return Boundary(rollout=label("rollout", cfg.rollout.name), scorer=label("scorer", cfg.reward.name),
                    environment=label("environment", cfg.environment.name) if cfg.environment.name else "",
                    algorithm=label("algorithm", cfg.algorithm.name), vocab_size=vocab_size(t),
                    on_invalid=getattr(cfg.reward.config, "on_invalid", "stop"))


def vocab_size(t: Any) -> int:
    """Token ids the policy of trainer ``t`` takes: its tokenizer's, or its model's embedding rows where more."""
    vocab = len(t.tokenizer)
    config = model_config(t) or {}
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        # A model may have more embedding rows than its tokenizer has tokens (Qwen: 151,936 and 151,665).
        vocab = max(vocab, int(config.get("vocab_size") or config.get("text_config", {}).get("vocab_size") or 0))
    return vocab


def reusable_old_log_probs(t: Any) -> bool:
    """The run's half of :func:`~verl_core.dataflow.old_log_probs_reusable`: only the actor update reads
    the old log-probs, which the actor computes (not the engine), and no dropout makes two forwards differ."""
    if not t.dataflow.old_log_probs_only_for_update:
        return False
    config = model_config(t)
    if config is None:
        return False  # unknown dropout: keep the forward
    settings = {**config, **dataclasses.asdict(t.config.backend.config)}
    return not any(isinstance(v, (int, float)) and v > 0 for k, v in settings.items()
                   if k.endswith(("dropout", "pdrop", "dropout_prob", "dropout_rate")))


def start_reward_model(t: Any, backend: Any, path: str) -> None:
    """Start the ``reward_model`` worker group on the training backend and hand it to the scorer."""
    from transformers import AutoTokenizer

    cfg = t.config
    spec = ModelSpec(path=path, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code)
    factory = functools.partial(_create_worker, backend, Role.REWARD_MODEL, spec, cfg.run.seed)
    group = t.executor.create_group(role=Role.REWARD_MODEL, factory=factory)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    t.reward.attach_reward_model(group, tokenizer)


def run_store(registry: Any, config: Config) -> RunStore:
    """The ``run.store`` plugin of ``config``, on its ``run.output_dir``."""
    store = plugin_for_key(registry, "run_store", config.run.store, "run.store")
    return store(Path(config.run.output_dir), keep=config.run.keep_checkpoints)


def data_reader(registry: Any, name: str) -> DataReader:
    """The data reader ``data.reader`` names, built; an unknown name's error starts with ``data.reader``."""
    return plugin_for_key(registry, "data_reader", name, "data.reader")()


def load_data(t: Any, format: str = "prompts") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Trainer ``t``'s training and validation rows, read by its data reader (``format``: the algorithm's
    :attr:`~verl_core.contracts.Requirements.data`) and checked once, where they enter the core."""
    cfg = t.config
    train, val, t.data_stats = data_reader(t.registry, cfg.data.reader).load(
        cfg.data, t.tokenizer, model_path=t.model_spec.path, registry=t.registry, format=format)
    source, vocab = plugin_label(t.registry, "data_reader", cfg.data.reader), vocab_size(t)
    for split, rows in (("training", train), ("validation", val)):
        check_prompt_rows(rows, source=source, split=split, vocab_size=vocab)
    check_rollout_multi_modal(t.registry.load("rollout", t.config.rollout.name), t.config.rollout.name,
                              [*train, *val])
    return train, val
