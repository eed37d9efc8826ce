"""Entry point: `python train.py [hydra overrides]`. See lightning_dist/run/cli.py and README.md."""

from lightning_dist.run.cli import main

if __name__ == "__main__":
    main()
