"""LoRA (Hu et al., 2021) on the lowered model, before the training graph is built: any frontend's
linear projections get rank-r adapters.

    y = matmul(x, permute_dims(W))   ->   y' = y + scale * matmul(matmul(x, permute_dims(A)),
                                                                 permute_dims(B))

for each weight W (out x in) of a module a scheme's ``lora.modules`` names. A (r x in) and B
(out x r) are new parameters of ``main``, after the model's own, named ``<module>.lora_a.weight``
and ``<module>.lora_b.weight`` in the source's names; A starts seeded Kaiming-uniform (bound
1/sqrt(in), as PEFT draws it), B at zero, so a fresh adapter changes nothing. The scheme's
rules then select what trains (usually ``*.lora_a`` and ``*.lora_b``, and a new head). The
PyTorch twin (models/torch_lora.py) adds the same adapters and loads these values.

Before::

    def main(x, w, b):
        wt = R.permute_dims(w, axes=[1, 0])
        y = R.matmul(x, wt)
        z = R.add(y, b)

After::

    def main(x, w, b, w_lora_a, w_lora_b):
        wt = R.permute_dims(w, axes=[1, 0])
        y = R.matmul(x, wt)
        y_lora = R.multiply(R.matmul(R.matmul(x, R.permute_dims(w_lora_a)),
                                     R.permute_dims(w_lora_b)), R.const(scale))
        y_adapted = R.add(y, y_lora)
        z = R.add(y_adapted, b)
"""
from __future__ import annotations

import math

import numpy as np
from tvm import relax

from pipelines.schema import ConfigError
from pipelines.ir import dtype_of, identifier, op_name, shape_of
from pipelines.patterns import module_matcher

SOURCE = "params.yaml (schemes, from conf/sparse): lora.modules"


def _targets(names: dict, lora) -> dict[str, str]:
    """Relax name of each weight to adapt -> its module path, in model order."""
    modules = {source.removesuffix(".weight"): relax_name
               for relax_name, (kind, source) in names.items()
               if kind == "parameter" and source.endswith(".weight")}
    targets = {}
    for pattern in lora.modules:
        try:
            match = module_matcher(pattern)
        except ValueError as err:  # an invalid "re:" pattern
            raise ConfigError(f"{SOURCE}: {err}") from None
        matched = [m for m in modules if match(m)]
        if not matched:
            shown = ", ".join(list(modules)[:12]) + (", ..." if len(modules) > 12 else "")
            raise ConfigError(f"{SOURCE}: {pattern!r} matches no module with a weight; the "
                              f"model's: {shown}")
        targets.update({modules[m]: m for m in matched})
    order = list(names)
    return dict(sorted(targets.items(), key=lambda item: order.index(item[0])))


@relax.expr_functor.mutator
class _Adapt(relax.PyExprMutator):
    def __init__(self, adapters: dict[str, tuple], scale: float):
        super().__init__()
        self.adapters, self.scale, self.adapted = adapters, scale, set()
        self.transposed: dict = {}  # var -> the adapted weight's name it is W^T of

    def visit_var_binding_(self, binding):
        value = binding.value
        if (op_name(value) == "relax.permute_dims" and isinstance(value.args[0], relax.Var)
                and value.args[0].name in self.adapters and len(shape_of(value.args[0])) == 2):
            self.transposed[binding.var] = value.args[0].name
        super().visit_var_binding_(binding)
        if op_name(value) != "relax.matmul" or value.args[1] not in self.transposed:
            return
        weight = self.transposed[value.args[1]]
        a, b = self.adapters[weight]
        x = self.visit_expr(value.args[0])
        y = self.visit_expr(binding.var)  # as emitted (its operands may have been adapted)
        low = self.builder_.emit(relax.op.matmul(x, relax.op.permute_dims(a)),
                                 f"{binding.var.name}_lora_in")
        delta = self.builder_.emit(relax.op.multiply(
            relax.op.matmul(low, relax.op.permute_dims(b)),
            relax.const(self.scale, dtype_of(binding.var))), f"{binding.var.name}_lora")
        adapted = self.builder_.emit(relax.op.add(y, delta), f"{binding.var.name}_adapted")
        self.set_var_remap(binding.var, adapted)
        self.adapted.add(weight)


def add_adapters(main: relax.Function, names: dict, num_params: int, lora, seed: int):
    """``main`` with LoRA adapters (above); the names table and the adapters' initial values
    (by Relax name), both for the new parameters only. ``names``: Relax name -> (kind, source
    name), the lower stage's; ``lora``: a pipelines/config.py LoRA."""
    count = int(main.attrs["num_input"])
    params = {p.name: p for p in main.params}
    targets = _targets(names, lora)
    not_linear = [m for w, m in targets.items() if len(shape_of(params[w])) != 2]
    if not_linear:  # e.g. a norm's scale: a weight, but not a projection's
        raise ConfigError(f"{SOURCE}: {not_linear[:4]} are not used as a linear projection's "
                          "weight (matmul(x, W^T)) in the model's graph; LoRA adapts linear layers")
    rng = np.random.default_rng(seed)
    taken = set(params)
    adapters, new_names, values, new_params = {}, {}, {}, []
    for weight, module in targets.items():
        out_features, in_features = shape_of(params[weight])
        dtype = dtype_of(params[weight])
        pair = []
        for suffix, shape in (("lora_a", [lora.rank, in_features]),
                              ("lora_b", [out_features, lora.rank])):
            source = f"{module}.{suffix}.weight"
            var = relax.Var(identifier(source, taken), relax.TensorType(shape, dtype))
            bound = 1 / math.sqrt(in_features)
            values[var.name] = (rng.uniform(-bound, bound, shape) if suffix == "lora_a"
                                else np.zeros(shape)).astype(dtype)
            new_names[var.name] = ("parameter", source)
            pair.append(var)
        adapters[weight] = tuple(pair)
        new_params += pair
    mutator = _Adapt(adapters, lora.scale)
    body = mutator.visit_expr(main.body)
    missing = [targets[w] for w in targets if w not in mutator.adapted]
    if missing:
        raise ConfigError(f"{SOURCE}: {missing[:4]} are not used as a linear projection's weight "
                          "(matmul(x, W^T)) in the model's graph; LoRA adapts linear layers")
    position = count + num_params  # after the model's parameters, before its buffers
    signature = [*main.params[:position], *new_params, *main.params[position:]]
    func = relax.Function(signature, body, main.ret_ty, main.is_pure, main.attrs)
    return func, new_names, values


def adapter_layers(layers: dict, new_names: dict, values: dict) -> dict:
    """layers.json with the adapters as linear layers of their own (``<module>.lora_a``), in
    their projection's block, so scheme rules select them by module path."""
    block_of = {p["module"]: p["block"] for p in layers["parameters"]}
    added = []
    for relax_name, (_, source) in new_names.items():
        module = source.removesuffix(".weight")
        added.append({"name": source, "module": module, "kind": "linear", "role": "weight",
                      "block": block_of.get(module.rsplit(".", 1)[0]),
                      "shape": list(values[relax_name].shape)})
    return {"blocks": layers["blocks"], "parameters": layers["parameters"] + added}
