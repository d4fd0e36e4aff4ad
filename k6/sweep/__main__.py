"""``python k6/sweep ...`` runs the sweep; ``--help`` lists the options.

Running a directory puts that directory on sys.path. Swap it for ``k6/`` so the package
imports as ``sweep`` (with ``make_images`` beside it), plus the repository root for
``app.settings``.
"""

import sys
from pathlib import Path

K6_DIR = Path(__file__).resolve().parent.parent
sys.path[0:1] = [str(K6_DIR), str(K6_DIR.parent)]

from sweep.cli import main  # noqa: E402

sys.exit(main())
