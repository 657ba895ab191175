"""`python -m mrlx_plugin.local.trainer --config job.yaml --model DIR ...`: one agent's embedded trainer."""

import sys

from mrlx_plugin.local.trainer.loop import main

sys.exit(main())
