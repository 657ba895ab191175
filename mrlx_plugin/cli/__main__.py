"""`python -m mrlx_plugin.cli ...`: the `mrlx` command without its console script."""

import sys

from mrlx_plugin.cli.main import main

sys.exit(main())
