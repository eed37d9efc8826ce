"""Entry point: `python train.py [hydra overrides]`. See lightning_dist/train.py and README.md."""

from lightning_dist.train import main

if __name__ == "__main__":
    main()
