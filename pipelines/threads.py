"""Thread counts for every process that builds or runs a CPU step: imported first by the modules
that do (the default schedules, the step runner), before TVM's pool or OpenBLAS starts."""
import os

# The parallel loops run on TVM's thread pool, which, left to itself, starts a thread per CPU
# of the whole machine, not of the CPUs this process may use (docs/tuning.md, "Threads"). Read
# when the pool starts, at the first kernel call; a caller that set it (the benchmark: the
# profile's cores) wins.
os.environ.setdefault("TVM_NUM_THREADS", str(len(os.sched_getaffinity(0))))
# A step whose products run on OpenBLAS (pipelines/backend/blas.py) calls it on one thread per task
# of TVM's pool. Loaded with its default, OpenBLAS starts worker threads of its own, unused but
# costly (docs/tuning.md, "Threads"). Read when the library loads, with the step's library.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
