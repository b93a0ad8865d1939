"""The reference subject: its trainers' parity, invariance and mutants."""
