"""Running: specs, torchrun and Slurm launches, the world, signals, in-process and pools."""
