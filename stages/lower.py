"""lower@<model>: the imported model as Relax IR, main(*inputs, *parameters, *buffers) ->
(logits, *new_buffers) (pipelines/compile.py: lower; phases.Lowered).

Output (artifacts/models/<model>/lower/): model.relax.py (TVMScript) and model.json;
params.npz, the initial value of every parameter and buffer by Relax name; names.json, Relax
name -> parameter or buffer and its name in the source; origins.json, binding -> source layer;
layers.json, what schemes select from.
"""
import sys

from pipelines.compile import lower
from pipelines.io import atomic_dir, write_manifest
from pipelines.layout import model_dir, resolved_model
from pipelines.resolve import model_inputs
from pipelines.stage import run_stage


def main(name: str) -> None:
    imported = model_dir(name, "import")
    lowered = lower(model_inputs(name).model, imported)
    with atomic_dir(model_dir(name, "lower")) as tmp:
        lowered.save(tmp)
        write_manifest(tmp, f"lower@{name}", {"import": imported,
                                              "inputs": resolved_model(name)}, {})
    print(f"lower@{name}: {len(lowered.state)} parameters and buffers")


if __name__ == "__main__":
    run_stage(main, sys.argv[1], phase="lower", model=sys.argv[1])
