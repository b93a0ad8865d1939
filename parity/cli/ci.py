"""`parity ci`: a CI workflow or script that runs `parity check` of HEAD (parity.ci)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    ci = sub.add_parser(
        "ci",
        help="print a CI workflow (GitHub Actions) or bash script that runs `parity check` of "
        "HEAD against its merge base with the spec",
    )
    ci.add_argument(
        "--spec",
        type=Path,
        required=True,
        help="the TOML/YAML job spec CI checks (checked now, as `parity spec` does)",
    )
    ci.add_argument(
        "--base",
        default=None,
        metavar="REF",
        help="the branch whose merge base with HEAD is side A, e.g. origin/main (default: "
        "github: the pull request's target branch; script: origin/main)",
    )
    ci.add_argument(
        "--format",
        choices=("github", "script"),
        default="github",
        help="github: a GitHub Actions workflow (default); script: bash for any CI",
    )
    ci.add_argument(
        "--install",
        default=None,
        metavar="CMD",
        help="the line that installs the harness (default: pip install llm-parity; '' leaves "
        "it out)",
    )
    ci.add_argument(
        "--project-install",
        default=None,
        metavar="CMD",
        help="your project's own install line, to edit (default: pip install -e .)",
    )
    ci.add_argument(
        "--python",
        default=None,
        metavar="VERSION",
        help="github: setup-python's python-version (default 3.11)",
    )
    ci.set_defaults(func=run)
    return ci


def run(args: argparse.Namespace) -> int:
    """Print the CI recipe (parity.ci) for the spec, after checking it as `parity spec` does."""
    from parity import ci

    ci.check_spec(args.spec)
    spec, warning = ci.spec_in_repo(args.spec)
    if warning:
        print(f"parity: warning: {warning}", file=sys.stderr)
    given = {"install": args.install, "project_install": args.project_install}
    given["python"] = args.python
    kept = {k: v for k, v in given.items() if v is not None}  # None: the recipe's default
    print(ci.render(spec, args.format, args.base, **kept), end="")
    return 0
