"""Entry point: `python train.py [hydra overrides]`. See lightning_dist/cli.py and README.md."""

from lightning_dist.cli import main

if __name__ == "__main__":
    main()
