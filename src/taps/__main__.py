"""`python -m taps ...`: the `taps` command."""

import sys

from taps.cli import main

sys.exit(main())
