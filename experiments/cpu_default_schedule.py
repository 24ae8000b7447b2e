"""Experiment: a generic default CPU schedule for every kernel of the optimized step."""
import json, shutil, sys, time
from collections import Counter
from pathlib import Path
import numpy as np, tvm
from tvm import s_tir, tirx
from pipelines.ir import load_ir
from pipelines.config import load_profile
from pipelines.step import CompiledStep, load_initial
from stages.build.toolchain import compile_step

def schedule(func):
    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root")
    blocks = sch.get_child_blocks(root)
    # inline everything inlinable (pads, elementwise producers, epilogues)
    for b in blocks:
        try: sch.compute_inline(b)
        except Exception: pass
    for b in reversed(sch.get_child_blocks(root)):
        try: sch.reverse_compute_inline(b)
        except Exception: pass
    kinds = Counter()
    for b in sch.get_child_blocks(root):
        block = sch.get(b)
        loops = sch.get_loops(b)
        if len(loops) != len(block.iter_vars):
            kinds["skip-loops"] += 1; continue
        types = [iv.iter_type for iv in block.iter_vars]  # 0 spatial, 2 reduce
        spatial = [l for l, t in zip(loops, types) if t == 0]
        reduce_ = [l for l, t in zip(loops, types) if t == 2]
        if len(spatial) + len(reduce_) != len(loops) or (reduce_ and loops.index(reduce_[0]) < len(spatial) and any(types[i] == 0 for i in range(loops.index(reduce_[0]), len(loops)))):
            kinds["skip-order"] += 1; continue
        ext = [int(sch.get(l).extent) for l in spatial]
        # innermost spatial loop with extent > 1
        idx = max((i for i, e in enumerate(ext) if e > 1), default=None)
        if idx is None:
            kinds["scalar"] += 1; continue
        inner = spatial[idx]
        if ext[idx] > 16:
            outer_i, inner = sch.split(inner, [None, 16])
            outer_sp = spatial[:idx] + [outer_i] + spatial[idx + 1:]
        else:
            outer_sp = spatial[:idx] + spatial[idx + 1:]
        sch.reorder(*outer_sp, *reduce_, inner)
        if outer_sp:
            fused = sch.fuse(*outer_sp) if len(outer_sp) > 1 else outer_sp[0]
            if int(sch.get(fused).extent) > 1:
                sch.parallel(fused)
        if reduce_:
            sch.decompose_reduction(b, reduce_[0])
            kinds["reduction"] += 1
        else:
            kinds["spatial"] += 1
        sch.unroll(inner)
    return sch.mod["main"].with_attr("tirx.is_scheduled", True), kinds

mod = load_ir(Path("artifacts/optimize/train_step.json"))
taken = Counter()
if sys.argv[1] == "sched":
    for gv, f in list(mod.functions_items()):
        if isinstance(f, tirx.PrimFunc):
            try:
                nf, k = schedule(f); mod[gv] = nf; taken.update(k)
            except Exception as e:
                taken["failed"] += 1
print(dict(taken))
out = Path(f"/tmp/build_{sys.argv[1]}"); shutil.rmtree(out, ignore_errors=True); out.mkdir()
compile_step(mod, load_profile("host", {}), out)
shutil.copy("artifacts/build/host/signature.json", out / "signature.json")
