"""Launching runs under Hydra (Hydra-side; the strategies know nothing of Hydra): each sweep job in a process of its
own (`isolated_job`), and one run per run directory (`run_dir`, which Hydra loads before the job: it imports no
Lightning, so a refused directory is said at once)."""
