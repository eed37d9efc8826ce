"""`python -m lightning_dist.equivalence ...`, the documented command (docs/strategies.md): reports/equivalence.py."""

import sys

from lightning_dist.reports.equivalence import main

if __name__ == "__main__":
    sys.exit(main())
