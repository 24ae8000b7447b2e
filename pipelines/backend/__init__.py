"""Everything that depends on the device: targets and toolchains, default CPU schedules, tuning
databases, kernel choice (OpenBLAS or generated code), GPU scheduling and CUDA fatbins; and the
one function that builds a step for a device profile (build.py)."""
