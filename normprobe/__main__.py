"""``python -m normprobe ...``: the same commands as the ``normprobe`` script."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
