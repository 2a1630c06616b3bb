"""``python -m medusa_infer.serving``: the ``medusa-serve`` command."""

import sys

from medusa_infer.serving.cli import main

sys.exit(main())
