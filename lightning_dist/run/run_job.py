"""`python .../run_job.py [overrides]`: one sweep job as a plain run; what `isolated_job.job_command` starts.

A script file rather than `python -m lightning_dist.run.cli`, so that the job's command line (which Lightning copies
for the ranks it starts) holds no `-m`; the same in a submitit worker, whose own command line is submitit's.
"""

from lightning_dist.run.cli import main

if __name__ == "__main__":
    main()
