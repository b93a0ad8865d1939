"""Orchestration: pairs, check and bisect over git, output folders."""
