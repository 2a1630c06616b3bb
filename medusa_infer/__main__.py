"""``python -m medusa_infer``: the ``medusa-generate`` command."""

import sys

from medusa_infer.cli import main

sys.exit(main())
