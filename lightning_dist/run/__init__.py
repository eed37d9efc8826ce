"""The run's edge, and the only place Hydra is spoken: the command line (`cli`), the job it runs (`job`: a training
run, `train`; a memory plan or a dry run, `simulate`), what a run is composed of (`compose`, one for all three), the
checkpoint it resumes from (`resume`), the checks before launch (`config_check`, `config_values`), one run per run
directory (`run_dir`, which Hydra loads before the job: it imports no Lightning, so a refused directory is said at
once), each rank's log and config (`per_rank`), and each sweep job in a process of its own (`isolated_job`).
The strategies and the floors below know nothing of Hydra or of this package."""
