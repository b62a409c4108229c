"""Slurm: fill the sbatch templates beside this file (submit.py) and start torchrun on each node (launch.py)."""
