"""A facade training script, as a user writes one: ``torchrun --nproc_per_node=2 train_grpo.py OUT [OVERRIDES...]``.

Run without torchrun it trains in one process; under torchrun, over every process. Rank 0 (the only
rank whose ``train()`` returns) writes what it trained to ``OUT/result.json``.
"""

import json
import os
import sys

from verl import GRPOTrainer

out, overrides = sys.argv[1], sys.argv[2:]
trainer = GRPOTrainer(output_dir=out, overrides=overrides)
metrics = trainer.train(max_steps=2)
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump({"pid": os.getpid(), "rank": os.environ.get("RANK"), "executor": trainer.config.executor.name,
               "metrics": metrics}, f)
