"""`python -m mrlx_lab.bench.credit [...]`: `mrlx bench credit`; with --unit, one unit of it."""

import sys

from mrlx_lab.bench.credit.run import main

sys.exit(main())
