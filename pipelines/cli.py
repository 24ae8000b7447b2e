"""The `pock` command line: compose the configuration, run parts of the pipeline through DVC,
inspect schemes, gate on regressions. Everything it builds or measures is a DVC stage, cached.

Exit codes: 0 success; 1 a check failed (stale params.yaml, a metric regressed beyond its
tolerance); 2 bad input (config, scheme, device, baseline) with a message naming the file and
key; 3 a pipeline stage failed (DVC's output above says which and why).
"""
from __future__ import annotations

import argparse
import subprocess
import sys

from pipelines.layout import stage_name
from pipelines.schema import HOST, ConfigError

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


def _params():
    from pipelines.config import load_params

    return load_params()


def _case(name: str | None) -> str:
    """A configured case (default: the first deployed one), or a ConfigError listing them."""
    params = _params()
    name = name or (params.deploy or list(params.cases))[0]
    if name not in params.cases:
        raise ConfigError(f"params.yaml: no case {name!r}; cases: {sorted(params.cases)}")
    return name


def _devices(case: str, requested: list[str]) -> list[str]:
    """The devices to act on: those asked for (each must be configured for the case)."""
    from pipelines.config import PARAMS
    from pipelines.profiles import load_profile

    params = _params()
    configured = [HOST, *(params.devices if case in params.deploy else [])]
    for device in requested:
        load_profile(device, params.profiles)  # an unknown name lists the profiles
        if device not in configured:
            devices = [*params.devices, *([] if device in params.devices else [device])]
            raise ConfigError(f"{PARAMS}: case {case!r} is built for {configured}, not {device!r};"
                              f" add it: pock compose 'devices=[{','.join(devices)}]'"
                              f" 'deploy=[{','.join(sorted({*params.deploy, case}))}]'")
    return requested or configured


def _repro(targets: list[str]) -> int:
    return EXIT_OK if subprocess.call(["dvc", "repro", *targets]) == 0 else EXIT_STAGE


def cmd_status(args) -> int:
    """What DVC would rerun, and why (changed deps or outs): params.yaml resolved first (the
    resolve stage, a second), since every stage after it depends on its resolved inputs. The
    default pipeline's stages (coverage/dvc.yaml is run on its own)."""
    code = subprocess.call(["dvc", "repro", "--quiet", "resolve"])
    return subprocess.call(["dvc", "status", "dvc.yaml"]) if code == 0 else EXIT_STAGE


def cmd_scheme_show(args) -> int:
    """Which parameters and channels each rule selects, and what the scheme saves."""
    import yaml

    from pipelines.io import read_json
    from pipelines.layout import case_dir, metrics_path
    from pipelines.report.scheme import render_scheme

    case = _case(args.case)
    code = _repro([stage_name("prune", case)])
    if code:
        return code
    rules = yaml.safe_load((case_dir(case, "prune") / "scheme.yaml").read_text())["rules"]
    print(render_scheme(case, rules, read_json(case_dir(case, "autodiff") / "layers.json"),
                        read_json(metrics_path("prune", case))))
    return EXIT_OK


def cmd_scheme_search(args) -> int:
    """Run a case whose scheme searches (prune@<case>) and keep what it found as a named
    scheme, conf/sparse/<name>.yaml."""
    from pipelines.config import CONF
    from pipelines.io import write_text_atomic
    from pipelines.layout import case_dir

    case = _case(args.case)
    if _params().schemes[_params().cases[case].scheme].search is None:
        raise ConfigError(f"params.yaml: case {case!r} has a scheme of rules, not a search; a "
                          "searching scheme: conf/sparse/searched.yaml")
    code = _repro([stage_name("prune", case)])
    if code:
        return code
    found = (case_dir(case, "prune") / "scheme.yaml").read_text()
    target = CONF / "sparse" / f"{args.name}.yaml"
    write_text_atomic(target, f"# Found by the search of case {case} (`pock scheme search`).\n"
                      + found)
    print(f"wrote {target}; add `- sparse@schemes.{args.name}: {args.name}` to "
          "conf/config.yaml's defaults to use it in a case")
    return EXIT_OK


def cmd_build(args) -> int:
    """Compile a case's training step for devices (cached when nothing changed)."""
    case = _case(args.case)
    return _repro([stage_name("build", case, d) for d in _devices(case, args.devices)])


def cmd_bench(args) -> int:
    """Evaluate a case on the host against PyTorch and run it on its devices; print a line
    each."""
    from pipelines.evaluate.device import summary
    from pipelines.io import read_json
    from pipelines.layout import metrics_path

    case = _case(args.case)
    devices = [d for d in _devices(case, args.devices) if d != HOST]
    code = _repro([stage_name("evaluate", case),
                   *(stage_name("benchmark", case, d) for d in devices)])
    if code:
        return code
    speed = read_json(metrics_path("evaluate", case)).get("speed")
    if speed:
        print(f"{case} host: compiled {speed['compiled']['median_ms']:.2f} ms/step; "
              + ", ".join(f"{v:.2f}x {k.removeprefix('speedup_vs_')}" for k, v in speed.items()
                          if k.startswith("speedup_vs_")))
    for device in devices:
        print(summary(read_json(metrics_path("benchmark", f"{case}-{device}"))))
    return EXIT_OK


def cmd_pretuned(args) -> int:
    """Merge the tune stages' records for a device into its committed, pre-tuned database."""
    from pipelines.backend.databases import WORKLOADS
    from pipelines.backend.tuning import merge_databases
    from pipelines.io import ARTIFACTS
    from pipelines.layout import pretuned
    from pipelines.profiles import resolved_profile, tvm_target

    tuned = sorted(d for d in (ARTIFACTS / "cases").glob(f"*/{args.device}/tune")
                   if (d / WORKLOADS).exists())
    if not tuned:
        raise ConfigError(f"{ARTIFACTS / 'cases'}: no tuning database for {args.device!r}; run "
                          f"the tune stages with the profile's tune.trials above 0 first, e.g. "
                          f"pock compose +profiles.{args.device}.tune.trials=2000 && dvc repro")
    committed = pretuned(args.device)
    count = merge_databases([committed, *tuned], committed,
                            tvm_target(resolved_profile(args.device)))
    print(f"{committed}: {count} kernels with a tuned schedule; commit it")
    return EXIT_OK


def cmd_setup(args) -> int:
    """Install what the configured devices need from Debian (cross compilers, qemu,
    mmdebstrap, the Docker engine; needs root), make their emulation roots and start dockerd
    where none answers."""
    from pipelines.profiles import load_profile
    from pipelines.setup import setup

    params = _params()
    names = args.devices or [HOST, *params.devices, *params.package.devices]
    profiles = [load_profile(d, params.profiles) for d in dict.fromkeys(names)]
    for line in setup(profiles, packaged=set(params.package.devices)):
        print(line, file=sys.stderr if line.startswith("warning:") else sys.stdout)
    return EXIT_OK


def cmd_emulation_setup(args) -> int:
    """Make the root an emulated device's step runs in (profile's emulation.root)."""
    from pipelines.profiles import load_profile
    from pipelines.runtime.emulation import emulation_root, setup_root

    profile = load_profile(args.device, _params().profiles)
    if profile.emulation is None:
        raise ConfigError(f"{profile.source}: no 'emulation' section; emulation needs "
                          "emulation.qemu and emulation.root")
    root = setup_root(profile, emulation_root(profile))
    print(f"emulation root for {args.device}: {root}")
    return EXIT_OK


def cmd_device_show(args) -> int:
    """The device's resolved profile, each key with where its value came from."""
    import yaml

    from pipelines.profiles import load_profile, profile_origins

    overrides = _params().profiles
    profile = load_profile(args.device, overrides).model_dump()
    origins = profile_origins(args.device, overrides)
    for key, value in profile.items():
        if key != "name":
            print(f"# {origins.get(key, 'the default')}")
        print(yaml.safe_dump({key: value}, sort_keys=False).rstrip())
    return EXIT_OK


def cmd_report(args) -> int:
    """Bring every stage up to date and write artifacts/report.md (and its plots)."""
    code = _repro(["report"])
    if code == EXIT_OK:
        print("report: artifacts/report.md (plots: artifacts/plots/*.svg; interactive: "
              "`dvc plots show`)")
    return code


def cmd_regress(args) -> int:
    """Current metrics against the baseline revision's, with the tolerances of regress.rules."""
    from pipelines.regress import gate, metrics_diff, render

    params = _params()
    baseline = args.baseline or params.regress.baseline
    verdicts = gate(metrics_diff(baseline), params.regress.rules)
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


def cmd_gpu_bundle(args) -> int:
    from pathlib import Path

    from pipelines.gpu import build_bundle

    cases = build_bundle(Path(args.out), args.overrides, args.profile, args.python,
                         args.parity_layers, tuple(args.unchained or ["mbv2"]),
                         runtime=not args.no_runtime)
    print(f"wrote {args.out}: {len(cases)} cases for {args.profile}")
    return EXIT_OK


def cmd_gpu_bench(args) -> int:
    from pipelines.gpu import bench
    from pipelines.io import read_json, write_json_atomic

    from pipelines.peers import PEERS

    unknown = sorted(set(args.peers or []) - set(PEERS))
    if unknown:
        raise ConfigError(f"--peers: no peer {unknown}; allowed: {sorted(PEERS)}")
    timing = {k: getattr(args, k) for k in ("warmup", "steps", "rounds", "min_seconds", "cores",
                                            "case_seconds", "peers", "runner_steps")}
    earlier = read_json(args.out) if args.add and args.out.exists() else {}
    bench(args.bundle, timing, args.case,
          lambda results: write_json_atomic(args.out, {**earlier, **results}))
    print(f"wrote {args.out}")
    return EXIT_OK


def _gpu_parser(sub) -> None:
    from pathlib import Path

    gpu = sub.add_parser("gpu", help="the GPU benchmark (docs/gpu.md): a bundle built here, "
                                     "run on a machine with an NVIDIA GPU")
    actions = gpu.add_subparsers(dest="action", required=True)
    q = actions.add_parser("bundle", help="compile experiment=gpu's cases for a GPU profile, "
                                          "with TVM's runtime and the GPU host's wheels")
    q.add_argument("overrides", nargs="*", help="Hydra overrides of experiment=gpu")
    q.add_argument("--out", default="artifacts/gpu/bundle")
    q.add_argument("--profile", default="nvidia_hopper")
    q.add_argument("--python", default="3.12", help="the GPU host's Python (for the wheels)")
    q.add_argument("--parity-layers", type=int, default=2,
                   help="a transformers model's layers in its parity build")
    q.add_argument("--unchained", action="append", metavar="MODEL",
                   help="a model whose parity steps each start from the initial state "
                        "(default mbv2: chained ReLU6 steps amplify rounding)")
    q.add_argument("--no-runtime", action="store_true",
                   help="leave out TVM's runtime and the wheels (a host that has them)")
    q.set_defaults(func=cmd_gpu_bundle)
    q = actions.add_parser("bench", help="run a bundle: parity against PyTorch on the same "
                                         "device, then speed and memory beside the peers")
    q.add_argument("bundle", type=Path)
    q.add_argument("out", type=Path, help="the metrics (JSON), written as each phase ends")
    q.add_argument("--case", action="append", help="only this case (repeatable, in order)")
    q.add_argument("--add", action="store_true",
                   help="keep the cases OUT holds and add these (a run in parts)")
    q.add_argument("--warmup", type=int, default=3)
    q.add_argument("--steps", type=int, default=10)
    q.add_argument("--rounds", type=int, default=2)
    q.add_argument("--min-seconds", type=float, default=1.0)
    q.add_argument("--cores", type=int, default=4, help="CPU threads of each case's process")
    q.add_argument("--peers", type=lambda text: text.split(","), metavar="PEER,...",
                   help="time these peers (pipelines/peers) beside every case instead of each "
                        "case's own (a peer that cannot do a case says why)")
    q.add_argument("--runner-steps", type=int, default=20,
                   help="steps of each speed build by the native and the Python runner, their "
                        "weights compared (0: not run)")
    q.add_argument("--case-seconds", type=float, default=600.0,
                   help="a case still running after this long is stopped and recorded")
    q.set_defaults(func=cmd_gpu_bench)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="pock", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True)
    p = sub.add_parser("compose", help="compose conf/ (+ Hydra overrides) into params.yaml")
    p.add_argument("overrides", nargs="*",
                   help="Hydra overrides, e.g. experiment=ci_lane cases.mbv2.scheme=full")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if params.yaml differs from conf/ composed without overrides")
    p.set_defaults(func=cmd_compose)
    p = sub.add_parser("status", help="which stages are stale and why (dvc repro resolve, then "
                                      "dvc status)")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("scheme", help="inspect a case's scheme, or keep what a search found")
    scheme = p.add_subparsers(dest="scheme_command", required=True)
    q = scheme.add_parser("show", help="what the case's scheme selects (per rule, with channels) "
                                       "and its backward FLOPs and memory vs full BP "
                                       "(dvc repro prune@<case>)")
    q.add_argument("case", nargs="?", help="a case of params.yaml (default: the first deployed)")
    q.set_defaults(func=cmd_scheme_show)
    q = scheme.add_parser("search", help="run a case whose scheme searches under a memory budget "
                                         "and write what it found to conf/sparse/<name>.yaml")
    q.add_argument("case", nargs="?", help="a case with a searching scheme")
    q.add_argument("--name", default="found", help="the scheme's name (default: found)")
    q.set_defaults(func=cmd_scheme_search)
    for name, func, what in (("build", cmd_build, "compile a case's training step per device"),
                             ("bench", cmd_bench, "evaluate a case against PyTorch on the host "
                                                  "and run it on its devices")):
        p = sub.add_parser(name, help=f"{what} (through DVC, cached)")
        p.add_argument("case", nargs="?", help="a case (default: the first deployed)")
        p.add_argument("devices", nargs="*", help="device profiles (default: all the case's)")
        p.set_defaults(func=func)
    p = sub.add_parser("pretuned", help="merge artifacts/cases/*/<device>/tune into the committed "
                                        "device_profiles/tuned/<device>")
    p.add_argument("device", help="a device profile whose tune stages have tuned")
    p.set_defaults(func=cmd_pretuned)
    p = sub.add_parser("setup", help="install the toolchains, emulation roots and Docker engine "
                                     "the configured devices need (Debian packages: as root)")
    p.add_argument("devices", nargs="*", help="device profiles (default: every configured one)")
    p.set_defaults(func=cmd_setup)
    p = sub.add_parser("emulation", help="emulated devices (qemu user mode)")
    q = p.add_subparsers(dest="action", required=True).add_parser(
        "setup", help="make the device's emulation root: Debian for its architecture "
                      "(mmdebstrap) plus its TVM and numpy wheels")
    q.add_argument("device", help="a device profile with an emulation section, e.g. rpi4")
    q.set_defaults(func=cmd_emulation_setup)
    p = sub.add_parser("device", help="device profiles")
    q = p.add_subparsers(dest="action", required=True).add_parser(
        "show", help="the resolved profile (extends followed, params.yaml's profiles.<name> "
                     "merged), each key with where it came from")
    q.add_argument("device", help="a profile name (device_profiles/, or derived in params.yaml)")
    q.set_defaults(func=cmd_device_show)
    p = sub.add_parser("report", help="run what is stale and write artifacts/report.md")
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("regress", help="gate: metrics against a committed baseline (dvc metrics "
                                       "diff), tolerances from regress.rules; exit 1 naming "
                                       "each metric that regressed")
    p.add_argument("--baseline", default=None,
                   help="git revision holding the baseline metrics (default: regress.baseline)")
    p.set_defaults(func=cmd_regress)
    _gpu_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from pathlib import Path

    from pipelines.io import repository

    if repository(Path.cwd().resolve()) is None:
        print(f"error: {Path.cwd()} is not in a pockengine checkout (a directory with dvc.yaml, "
              "conf/ and pipelines/); pock acts on the checkout of the current directory",
              file=sys.stderr)
        return EXIT_INPUT
    from pipelines.io import CorruptArtifact

    try:
        return args.func(args)
    except (ConfigError, CorruptArtifact) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main())
