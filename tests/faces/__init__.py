"""The faces: the CLI, the pytest plugin, the report, the README and docs."""
