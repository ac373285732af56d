"""`python -m worker.cli ...` runs the `kvrq` command line (tests and spawned workers use it)."""

import sys

from worker.cli.main import main

sys.exit(main())
