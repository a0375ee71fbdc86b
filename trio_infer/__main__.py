"""``python -m trio_infer`` is the ``trio-infer`` command."""

import sys

from trio_infer.cli import main

sys.exit(main())
