"""`python -m taps ...`: the `taps` command."""

import sys

from taps.cli.main import main

sys.exit(main())
