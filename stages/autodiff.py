"""autodiff@<case>: loss + reverse-mode gradient + optimizer update, one Relax function, for
the case's model, optimizer and LoRA adapters (pipelines/compile.py: training_graph); the batch
norms of layers the scheme leaves frozen (all a search may choose from, for a search) keep
their running statistics; a rule's ``lr_scale`` scales its parameters' learning rate.

Output (artifacts/cases/<case>/autodiff/, a phases.TrainingStep): train_step.relax.py / .json,
the full training step (every parameter updated); signature.json, its inputs and outputs in
order with the source's names; initial.npz, every parameter and buffer's initial value (the
model's, the adapters'); layers.json, what the case's schemes select from (the model's layers
and its adapters).
"""
import sys

from pipelines.compile import training_graph
from pipelines.io import atomic_dir, write_manifest
from pipelines.layout import case_dir, model_dir, resolved_case
from pipelines.phases import Lowered
from pipelines.resolve import case_inputs
from pipelines.search import search_space
from pipelines.stage import run_stage


def main(name: str) -> None:
    inputs = case_inputs(name, "autodiff")
    lowered = model_dir(inputs.model, "lower")
    model = Lowered.load(lowered)
    rules = inputs.rules or None
    if inputs.search:
        rules = search_space(inputs.search, model.layers)
    full = training_graph(model, inputs.optimizer, inputs.lora, inputs.seed, inputs.task, rules,
                          inputs.statistics)
    with atomic_dir(case_dir(name, "autodiff")) as tmp:
        full.save(tmp)
        write_manifest(tmp, f"autodiff@{name}", {"lower": lowered,
                                                 "inputs": resolved_case(name, "autodiff")}, {})
    print(f"autodiff@{name}: train_step with {len(full.module['train_step'].params)} inputs")


if __name__ == "__main__":
    run_stage(main, sys.argv[1], phase="autodiff")
