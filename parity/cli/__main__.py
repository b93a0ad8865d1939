"""`python -m parity.cli`: the `parity` command."""

import sys

from parity.cli import main

sys.exit(main())
