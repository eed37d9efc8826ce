"""`python -m lightning_dist.sweep_report DIR`, the documented command (README.md): reports/sweep_report.py."""

from lightning_dist.reports.sweep_report import main

if __name__ == "__main__":
    main()
