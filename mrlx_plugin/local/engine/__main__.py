"""`python -m mrlx_plugin.local.engine --model DIR [...]`: `mrlx engine` without the `mrlx` command."""

import sys

from mrlx_plugin.local.engine.command import main

sys.exit(main())
