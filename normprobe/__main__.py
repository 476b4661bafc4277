"""``python -m normprobe ...``: the same commands as the ``normprobe`` script."""

from .cli import main

raise SystemExit(main())
