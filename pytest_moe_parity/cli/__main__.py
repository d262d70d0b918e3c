"""`python -m pytest_moe_parity.cli`: the `moe-parity` command."""

import sys

from . import main

sys.exit(main())
