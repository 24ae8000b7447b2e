"""The `pock` command line.

Exit codes: 0 success; 1 a check failed (stale params.yaml); 2 bad input (config, scheme,
device) with a message naming the file and key.
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from pipelines.config import ConfigError

EXIT_OK, EXIT_CHECK, EXIT_INPUT = 0, 1, 2


def cmd_compose(args) -> int:
    from pipelines.compose import compose, is_stale

    if args.check:
        if args.overrides:
            raise ConfigError("pock compose --check takes no overrides")
        if is_stale():
            print("params.yaml is stale against conf/: run `pock compose` and commit it",
                  file=sys.stderr)
            return EXIT_CHECK
        print("params.yaml is up to date with conf/")
        return EXIT_OK
    compose(args.overrides)
    print("wrote params.yaml" + (f" with {' '.join(args.overrides)}" if args.overrides else ""))
    return EXIT_OK


def cmd_status(args) -> int:
    """What DVC would rerun, and why (changed deps, params or outs)."""
    return subprocess.call(["dvc", "status"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pock", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compose", help="compose conf/ (+ Hydra overrides) into params.yaml")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. sparse=full model.width=0.5")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if params.yaml differs from conf/ composed without overrides")
    p.set_defaults(func=cmd_compose)
    p = sub.add_parser("status", help="which stages are stale and why (dvc status)")
    p.set_defaults(func=cmd_status)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main())
