"""Third-party training stacks run as parity subjects, each in its own cached environment."""
