"""``python -m benchmarks.device``: see :mod:`benchmarks.device.cli`."""

import sys

from benchmarks.device.cli import main

sys.exit(main())
