"""``python -m verl_cli`` is ``verl``."""

import sys

from verl_cli.cli import main

sys.exit(main())
