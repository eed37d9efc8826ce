"""The names configs written before lightning_dist/run/ kept: `lightning_dist.launch.run_dir.OneRunPerDirectory`
in a copied `hydra.callbacks` still loads."""
