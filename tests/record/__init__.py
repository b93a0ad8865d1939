"""The recorder a foreign loop calls, and op traces."""
