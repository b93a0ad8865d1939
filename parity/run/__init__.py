"""Running: one job's torchruns started, watched and stopped (launch: here; slurm: on a Slurm
cluster; job: a spec into a run folder), both sides in one launch (inprocess), warm pools, the
op-trace rerun, the world the ranks formed, and signals. What runs inside the ranks themselves
(the start-up hook, the warm process, the mutants) is parity.rank's.
"""
