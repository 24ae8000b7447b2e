"""profiles: resolve each configured device's profile into one JSON file.

Usage: python -m stages.profiles
Output: artifacts/profiles/<device>.json for every device in ``devices`` (host always among
them): device_profiles/<device>.yaml, with ``extends`` followed and params.yaml's
``profiles.<device>`` (Hydra overrides) merged on top, checked. Build and benchmark stages
depend on their device's file only, so a change to one profile, or adding a board, rebuilds
that board and nothing else.
"""
from __future__ import annotations

from pipelines.artifacts import ARTIFACTS, atomic_dir, write_json_atomic
from pipelines.config import load_params, load_profile, require, run_stage


def main() -> None:
    params = load_params()
    overrides = params.get("profiles") or {}
    resolved = {name: load_profile(name, overrides) for name in require(params, "devices")}
    with atomic_dir(ARTIFACTS / "profiles") as tmp:  # all or nothing
        for name, profile in resolved.items():
            write_json_atomic(tmp / f"{name}.json", profile)
    print(f"profiles: {', '.join(resolved)}")


if __name__ == "__main__":
    run_stage(main)
