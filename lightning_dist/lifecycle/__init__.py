"""A process's life and its end, below everything else but `_compat`: exit codes and one-line exits (`exits`), stop
signals, the quick exit, what the ranks of a torchrun job tell each other before their group forms (`job_store`),
collectives that time out, peers that leave, the build lock of DeepSpeed's native ops, and writable directories.
Nothing here imports the edge (lightning_dist/run/) or an engine."""
