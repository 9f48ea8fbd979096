"""verl-run-store tests. The session cache (``verl_cache``) and the CLI fixture (``run_verl``) come from the
repository's root ``conftest.py``, shared with the other test trees."""

import torch

# The machine is shared: one thread keeps these tests from stealing cores.
torch.set_num_threads(1)
