"""lower@<model>: the imported model as Relax IR, main(*inputs, *parameters, *buffers) ->
(logits, *new_buffers).

Output (artifacts/models/<model>/lower/): model.relax.py (TVMScript) and model.json;
params.npz, the initial value of every parameter and buffer by Relax name; names.json, Relax
name -> parameter or buffer and its name in the source; origins.json, binding -> source layer.
"""
import sys

import tvm

from pipelines.config import load_params, run_stage
from pipelines.frontends import lower_model
from pipelines.io import atomic_dir, save_arrays, write_json_atomic, write_manifest
from pipelines.ir import save_ir
from pipelines.layout import model_dir


def main(name: str) -> None:
    model = load_params().models[name]
    imported = model_dir(name, "import")
    func, names, origins, values = lower_model(model, imported)
    state = [v.name for v in func.params[int(func.attrs["num_input"]):]]
    with atomic_dir(model_dir(name, "lower")) as tmp:
        save_ir(tvm.IRModule({"main": func}), tmp, "model")
        save_arrays(tmp / "params.npz", {n: values[n] for n in state})
        write_json_atomic(tmp / "names.json", {n: list(names[n]) for n in state})
        write_json_atomic(tmp / "origins.json", origins)
        write_manifest(tmp, f"lower@{name}", {"import": imported}, {})
    print(f"lower@{name}: {len(state)} parameters and buffers")


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1]))
