"""``python -m jscaler.cli``: the ``jscaler`` command (``jscaler launch`` starts its
processes this way)."""

import sys

from jscaler.cli import main

sys.exit(main())
