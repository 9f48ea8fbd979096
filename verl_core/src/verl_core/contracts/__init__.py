"""The plugin contracts, one module per plugin kind. Plugins import them from here::

    from verl_core.contracts import Algorithm, RolloutEngine, TrainingWorker

Each extension kind has one uniform interface with keyword-only arguments over the typed
:class:`~verl_core.batch.Batch`: training backends (worker roles), rollout engines, algorithms, rewards,
environments, executors, step sources, config formats, data readers and run stores. The controller talks to plugins
only through these, so it never needs to know which plugin it drives. The conformance suites in
:mod:`verl_core.testing` check an implementation against them.
"""

from verl_core.contracts.common import *  # noqa: F403
from verl_core.contracts.backend import *  # noqa: F403
from verl_core.contracts.rollout import *  # noqa: F403
from verl_core.contracts.algorithm import *  # noqa: F403
from verl_core.contracts.reward import *  # noqa: F403
from verl_core.contracts.environment import *  # noqa: F403
from verl_core.contracts.executor import *  # noqa: F403
from verl_core.contracts.providers import *  # noqa: F403
from verl_core.contracts.config_format import *  # noqa: F403
from verl_core.contracts.step_source import *  # noqa: F403
from verl_core.contracts.data import *  # noqa: F403
from verl_core.contracts.run_store import *  # noqa: F403

from verl_core.contracts import (algorithm, backend, common, config_format, data, environment, executor,
                                 providers, reward, rollout, run_store, step_source)

# Each module declares its public names once, in its own __all__ (in a form type checkers follow).
__all__: list[str] = []
__all__ += common.__all__
__all__ += backend.__all__
__all__ += rollout.__all__
__all__ += algorithm.__all__
__all__ += reward.__all__
__all__ += environment.__all__
__all__ += executor.__all__
__all__ += providers.__all__
__all__ += config_format.__all__
__all__ += step_source.__all__
__all__ += data.__all__
__all__ += run_store.__all__
