"""The tests, one folder per layer of the code (tests/README.md)."""
