"""The `pock` command line: compose the configuration, run the pipeline's phases through DVC,
inspect schemes, gate on regressions.

Exit codes: 0 success; 1 a check failed (stale params.yaml, a metric regressed beyond its
tolerance); 2 bad input (config, scheme, device, baseline) with a message naming the file and
key; 3 a pipeline stage failed (DVC's output above says which and why).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from pipelines.config import ConfigError

EXIT_OK, EXIT_CHECK, EXIT_INPUT, EXIT_STAGE = 0, 1, 2, 3


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
    layers, full, signature = full_step(require(params, "model"), require(params, "optimizer"),
                                        scheme.get("lora"), int(params.get("seed", 0)))
    print(render(scheme, layers, prune_scheme(scheme, layers, full, signature)[2]))
    return EXIT_OK


def cmd_scheme_search(args) -> int:
    """Measure candidates' contributions and choose a scheme under a memory budget."""
    from stages.search.__main__ import cli

    cli(args.budget_mb, args.name)
    return EXIT_OK


def _configured_devices() -> list[str]:
    from pipelines.config import load_params, require

    return list(require(load_params(), "devices"))


def _devices(requested: list[str]) -> list[str]:
    """The devices to act on: those asked for (each must be configured), else all configured."""
    from pipelines.config import PARAMS, load_profile

    configured = _configured_devices()
    for device in requested:
        load_profile(device)  # an unknown name lists the profiles
        if device not in configured:
            raise ConfigError(f"{PARAMS}: devices={configured} does not include {device!r}; "
                              f"add it: pock compose 'devices=[{','.join(configured + [device])}]'")
    return requested or configured


def _repro(targets: list[str]) -> int:
    return EXIT_OK if subprocess.call(["dvc", "repro", *targets]) == 0 else EXIT_STAGE


def cmd_build(args) -> int:
    """Compile the training step for devices (dvc repro build@<device>: cached when nothing
    changed)."""
    return _repro([f"build@{d}" for d in _devices(args.devices)])


def cmd_pretuned(args) -> int:
    """Merge the tune stage's records for a device into its committed, pre-tuned database."""
    from pipelines.artifacts import ARTIFACTS
    from pipelines.config import resolved_profile, tvm_target
    from pipelines.tuning import PRETUNED, WORKLOADS, merge_databases

    from stages.workloads.__main__ import DEVICE as WORKLOADS_DEVICE

    tuned = [ARTIFACTS / "tune" / args.device]
    if args.device == WORKLOADS_DEVICE:  # the profile the workloads' steps are built on
        tuned.append(ARTIFACTS / "tune_workloads")
    tuned = [directory for directory in tuned if (directory / WORKLOADS).exists()]
    if not tuned:
        raise ConfigError(f"{ARTIFACTS / 'tune' / args.device}: no tuning database; run "
                          f"`dvc repro tune@{args.device}` with the profile's tune.trials above "
                          f"0 first")
    count = merge_databases([PRETUNED / args.device, *tuned], PRETUNED / args.device,
                            tvm_target(resolved_profile(args.device)))
    print(f"{PRETUNED / args.device}: {count} kernels with a tuned schedule; commit it")
    return EXIT_OK


def cmd_bench(args) -> int:
    """Benchmark the compiled step against PyTorch on devices, then print the ratios."""
    import json

    from pipelines.artifacts import ARTIFACTS

    devices = _devices(args.devices)
    code = _repro([f"benchmark@{d}" for d in devices])
    if code:
        return code
    from stages.benchmark.__main__ import summary

    for device in devices:
        print(summary(json.loads((ARTIFACTS / "benchmark" / f"{device}.json").read_text())))
    return EXIT_OK


def cmd_setup(args) -> int:
    """Install what the configured devices need from Debian (cross compilers, qemu,
    mmdebstrap, the Docker engine; needs root), make their emulation roots and start dockerd
    where none answers."""
    import shutil

    from pipelines.config import load_profile
    from pipelines.emulation import emulation_root, root_is_ready, setup_root

    profiles = [load_profile(d) for d in _devices(args.devices)]
    needed = {}  # tool -> the Debian package that provides it
    for profile in profiles:
        if profile["toolchain"].get("cc") and profile["toolchain"].get("package"):
            needed[profile["toolchain"]["cc"]] = profile["toolchain"]["package"]
        if profile["runner"] == "emulated":
            needed.update({profile["emulation"]["qemu"]: "qemu-user-static",
                           "mmdebstrap": "mmdebstrap"})
        if profile["runner"] == "docker":
            needed.update({"dockerd": "docker.io", "mmdebstrap": "mmdebstrap"})
    packages = sorted({package for tool, package in needed.items() if not shutil.which(tool)})
    if packages:
        print(f"apt-get install {' '.join(packages)}")
        subprocess.call(["apt-get", "update", "-q"])
        if subprocess.call(["apt-get", "install", "-y", "-q", *packages]) != 0:
            raise ConfigError(f"apt-get could not install {packages} (root and Debian's "
                              "package registry needed)")
    for profile in profiles:
        if profile["target"]["kind"] == "cuda" and not shutil.which("nvcc"):
            print(f"warning: {profile['name']} compiles CUDA kernels with nvcc, which is not on "
                  "PATH (NVIDIA's CUDA toolkit; not installed by pock setup)", file=sys.stderr)
        if profile["runner"] == "emulated":
            root = emulation_root(profile)
            if not root_is_ready(root):
                print(f"emulation root for {profile['name']}: {setup_root(profile, root)}")
    if any(profile["runner"] == "docker" for profile in profiles):
        from pipelines.images import start_engine

        print(f"docker: {start_engine()}")
    return EXIT_OK


def cmd_emulation_setup(args) -> int:
    """Make the root an emulated device's step runs in (profile's emulation.root)."""
    from pipelines.config import load_profile
    from pipelines.emulation import emulation_root, setup_root

    profile = load_profile(args.device)
    if not profile.get("emulation"):
        raise ConfigError(f"device_profiles/{args.device}.yaml: no 'emulation' section; "
                          "emulation needs emulation.qemu and emulation.root")
    root = setup_root(profile, emulation_root(profile))
    print(f"emulation root for {args.device}: {root}")
    return EXIT_OK


def cmd_report(args) -> int:
    """Bring every stage up to date and write artifacts/report.md (and its plots)."""
    code = _repro(["report"])
    if code == EXIT_OK:
        print("report: artifacts/report.md (plots: artifacts/plots/*.svg; interactive: "
              "`dvc plots show`)")
    return code


def _gate_inputs(args) -> tuple[list, str, None]:
    """(rules, baseline revision, repository directory: None for this one)."""
    from pipelines.config import load_params, require
    from pipelines.regress import check_rules

    params = load_params()
    return (check_rules(require(params, "regress.rules")),
            args.baseline or require(params, "regress.baseline"), None)


def cmd_regress(args) -> int:
    """Current metrics against the baseline revision's, with the tolerances of regress.rules."""
    from pipelines.regress import gate, metrics_diff, render

    rules, baseline, repo = _gate_inputs(args)
    verdicts = gate(metrics_diff(baseline, cwd=repo), rules)
    if not any(v["baseline"] is not None for v in verdicts):
        raise ConfigError(f"baseline {baseline!r} holds none of the metrics regress.rules name; "
                          "commit metrics files (`dvc repro`, then `git add artifacts`) or pass "
                          "--baseline REV")
    print(render(verdicts, baseline))
    failed = [v for v in verdicts if v["verdict"] in ("regressed", "missing")]
    for v in failed:
        print(f"REGRESSED: {v['metric']}: {v['verdict']} (baseline {v['baseline']}, current "
              f"{v['current']}, allowed {v['allowed']})", file=sys.stderr)
    print(f"{len(verdicts)} metrics gated against {baseline}: "
          f"{len(failed)} regressed beyond tolerance")
    return EXIT_CHECK if failed else EXIT_OK


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
    p = sub.add_parser("build", help="compile the training step per device (dvc repro "
                                     "build@<device>)")
    p.add_argument("devices", nargs="*", help="device profiles (default: params.yaml devices)")
    p.set_defaults(func=cmd_build)
    p = sub.add_parser("pretuned", help="merge artifacts/tune/<device> (for host also "
                                        "artifacts/tune_workloads) into the committed "
                                        "device_profiles/tuned/<device>")
    p.add_argument("device", help="a device profile whose tune stage has run")
    p.set_defaults(func=cmd_pretuned)
    p = sub.add_parser("bench", help="benchmark compiled vs PyTorch per device (dvc repro "
                                     "benchmark@<device>) and print the ratios")
    p.add_argument("devices", nargs="*", help="device profiles (default: params.yaml devices)")
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("setup", help="install the toolchains and emulation roots the configured "
                                     "devices need (Debian packages: run as root)")
    p.add_argument("devices", nargs="*", help="device profiles (default: params.yaml devices)")
    p.set_defaults(func=cmd_setup)
    p = sub.add_parser("emulation", help="emulated devices (qemu user mode)")
    q = p.add_subparsers(dest="action", required=True).add_parser(
        "setup", help="make the device's emulation root: Debian for its architecture "
                      "(mmdebstrap) plus its TVM and numpy wheels")
    q.add_argument("device", help="a device profile with an emulation section, e.g. rpi4")
    q.set_defaults(func=cmd_emulation_setup)
    p = sub.add_parser("report", help="run what is stale and write artifacts/report.md")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("regress", help="gate: metrics against a committed baseline (dvc metrics "
                                       "diff), tolerances from regress.rules; exit 1 naming "
                                       "each metric that regressed")
    p.add_argument("--baseline", default=None,
                   help="git revision holding the baseline metrics (default: regress.baseline)")
    p.set_defaults(func=cmd_regress)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main())
