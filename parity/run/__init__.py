"""Running: one job's torchruns started, watched and stopped (launch: here; slurm: on a Slurm
cluster; job: a spec into a run folder), the mutants injected into its ranks, both sides in one
launch (inprocess), warm pools, the op-trace rerun, the world the ranks formed, and signals.
"""
