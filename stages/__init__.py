"""DVC's entry points, one module per stage (dvc.yaml runs `python -m stages.<name> ...`): each
reads its params and upstream files, calls the library (pipelines/) and writes its outputs
atomically. No stage imports another."""
