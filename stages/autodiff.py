"""autodiff@<case>: loss + reverse-mode gradient + optimizer update, one Relax function, for
the case's model, optimizer and LoRA adapters (pipelines/compile.py: training_graph).

Output (artifacts/cases/<case>/autodiff/): train_step.relax.py / .json, the full training step
(every parameter updated); signature.json, its inputs and outputs in order with the source's
names; initial.npz, every parameter and buffer's initial value (the model's, the adapters');
layers.json, what the case's schemes select from (the model's layers and its adapters).
"""
import sys

from pipelines.compile import case_layers, training_graph
from pipelines.config import case_optimizer, load_params, run_stage
from pipelines.io import atomic_dir, load_arrays, read_json, save_arrays, write_json_atomic, write_manifest
from pipelines.ir import load_ir, save_ir
from pipelines.layout import case_dir, model_dir


def main(name: str) -> None:
    params = load_params()
    case = params.cases[name]
    lowered = model_dir(case.model, "lower")
    names = {k: tuple(v) for k, v in read_json(lowered / "names.json").items()}
    full, adapters, values = training_graph(
        load_ir(lowered / "model.json")["main"], names, read_json(lowered / "origins.json"),
        case_optimizer(params, case), params.schemes[case.scheme].lora, params.seed,
        params.models[case.model].task)
    layers = read_json(model_dir(case.model, "import") / "layers.json")
    with atomic_dir(case_dir(name, "autodiff")) as tmp:
        save_ir(full, tmp, "train_step")
        save_arrays(tmp / "initial.npz", {**load_arrays(lowered / "params.npz"), **values})
        write_json_atomic(tmp / "layers.json", case_layers(layers, adapters, values))
        write_manifest(tmp, f"autodiff@{name}", {"lower": lowered},
                       {"case": case.model_dump(), "seed": params.seed})
    print(f"autodiff@{name}: train_step with {len(full['train_step'].params)} inputs")


if __name__ == "__main__":
    run_stage(lambda: main(sys.argv[1]))
