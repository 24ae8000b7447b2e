"""profiles: each device profile the pipeline builds for, resolved into one JSON file.

Output: artifacts/profiles/<device>.json for the host and every device in ``devices``:
device_profiles/<device>.yaml, with ``extends`` followed and params.yaml's ``profiles.<device>``
(Hydra overrides) merged on top, checked. Builds depend on their device's file only, so a
change to one profile, or a new board, rebuilds that board and nothing else.
"""
from pipelines.config import HOST, load_params, run_stage
from pipelines.io import ARTIFACTS, atomic_dir, write_json_atomic
from pipelines.profiles import load_profile


def main() -> None:
    params = load_params()
    resolved = {name: load_profile(name, params.profiles) for name in [HOST, *params.devices]}
    with atomic_dir(ARTIFACTS / "profiles") as tmp:  # all or nothing
        for name, profile in resolved.items():
            write_json_atomic(tmp / f"{name}.json", profile)
    print(f"profiles: {', '.join(resolved)}")


if __name__ == "__main__":
    run_stage(main)
