"""``python -m fxckpt``: the ``fxckpt`` command, where the console script is not on the path
(a source tree run with ``PYTHONPATH=.``, say)."""

import sys

from fxckpt.cli import main

sys.exit(main())
