import time, numpy as np, os
os.environ["TVM_NUM_THREADS"] = "2"
from pathlib import Path
from pipelines.step import CompiledStep, load_initial
init = load_initial(Path("artifacts/lower/params.npz"))
d = np.load("artifacts/data/digits.npz"); x, y = d["finetune_train_x"][:8], d["finetune_train_y"][:8]
steps = {k: CompiledStep(Path(f"/tmp/build_{k}"), init) for k in ("plain", "sched")}
args = {k: s.arguments(x, y) for k, s in steps.items()}
outs = {k: [o.numpy() for o in s.function(*args[k])] for k, s in steps.items()}
print("loss", outs["plain"][0], outs["sched"][0])
worst = max(float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))) for a, b in zip(outs["sched"], outs["plain"]))
print("max rel diff over outputs", worst)
t = {k: [] for k in steps}
for r in range(5):
    for k, s in steps.items():
        for _ in range(3): s.function(*args[k])
        for _ in range(10):
            a = time.perf_counter(); s.function(*args[k]); t[k].append(time.perf_counter() - a)
for k in t: print(k, f"{np.median(t[k])*1e3:.2f} ms")
bad = 0
for i, (a, b) in enumerate(zip(outs["sched"], outs["plain"])):
    if not np.allclose(a, b, rtol=1e-4, atol=1e-5):
        bad += 1; print(i, a.shape, np.abs(a-b).max(), np.abs(b).max())
print("outputs not within rtol 1e-4 atol 1e-5:", bad, "of", len(outs["plain"]))
