"""`python -m mrlx_lab.bench.coordinator [--samples N --tokens N ...]`: `mrlx bench coordinator`."""

import sys

from mrlx_lab.bench.coordinator.run import main

sys.exit(main())
