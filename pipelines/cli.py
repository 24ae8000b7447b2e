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


def _configured(overrides: list[str]) -> dict:
    """params.yaml, or conf/ composed with ``overrides`` (in memory, nothing written)."""
    import yaml

    from pipelines.compose import compose_text
    from pipelines.config import load_params

    return yaml.safe_load(compose_text(overrides)) if overrides else load_params()


def cmd_scheme_show(args) -> int:
    """Which parameters and channels each rule selects, and what the scheme saves."""
    from pipelines.config import require
    from stages.prune.__main__ import prune_scheme
    from stages.prune.show import full_step, render

    params = _configured(args.overrides)
    scheme = require(params, "sparse")
    layers, full, signature = full_step(require(params, "model"), require(params, "optimizer"))
    print(render(scheme, layers, prune_scheme(scheme, layers, full, signature)[2]))
    return EXIT_OK


def cmd_scheme_search(args) -> int:
    """Measure candidates' contributions and choose a scheme under a memory budget."""
    from stages.search.__main__ import cli

    cli(args.budget_mb, args.name)
    return EXIT_OK


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
    p = sub.add_parser("scheme", help="inspect sparse-update schemes or search for one")
    scheme = p.add_subparsers(dest="scheme_command", required=True)
    q = scheme.add_parser("show", help="what the configured scheme selects (per rule, with "
                                       "channels) and its backward FLOPs and memory vs full BP")
    q.add_argument("overrides", nargs="*",
                   help="Hydra overrides to show another configuration, e.g. sparse=tiny_budget")
    q.set_defaults(func=cmd_scheme_show)
    q = scheme.add_parser("search", help="choose layers and channel ratios under a memory "
                                         "budget from measured contributions; writes "
                                         "conf/sparse/<name>.yaml (needs `dvc repro autodiff`)")
    q.add_argument("--budget-mb", type=float, default=None,
                   help="parameter gradients + optimizer state + saved activations, in MiB "
                        "(default: search.budget_mb)")
    q.add_argument("--name", default=None, help="scheme name (default: search.name)")
    q.set_defaults(func=cmd_scheme_search)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main())
