"""Judging: two runs' metrics compared under per-metric policies (policy, ulp, compare), the
noise floor, goldens, the diagnosis down to the first differing op (diagnose, opdiff), the
on-policy chain, and where the ranks ran (topology). Reads frames and files; runs nothing.
"""
