"""``python -m composer.cli``: the ``kvc`` command."""

import sys

from composer.cli import main

sys.exit(main())
