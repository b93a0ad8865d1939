"""Judging: compare, policies, noise floor, goldens, diagnosis, the on-policy chain."""
