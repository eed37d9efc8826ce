"""torch's slice: DDP (ddp.py) and FSDP2 (fsdp.py), FSDP2's sharding per block (fully_shard.py), and the dry run's
replay of both (dry_run.py). Nothing outside strategies/ imports it."""
