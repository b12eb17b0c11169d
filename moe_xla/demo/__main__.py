"""`python3 -m moe_xla.demo [options]`: see moe_xla.demo; exit status 1 when the loss did not fall."""

import sys

from moe_xla.demo.cli import main

sys.exit(0 if main()["loss_fell"] else 1)
