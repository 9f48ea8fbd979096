"""verl-executor-local tests."""

import torch

# The machine is shared: one thread keeps these tests from stealing cores.
torch.set_num_threads(1)
