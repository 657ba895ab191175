"""`python -m mrlx_lab.stub_engine [--port 0 --port-file F ...]`: `mrlx stub-engine` without the
`mrlx` command."""

import sys

from mrlx_lab.stub_engine.command import main

sys.exit(main())
