"""The tables a model's integer inputs index: for each, the fewest rows of a ``take`` it
feeds (through casts and reshapes). A batch's ids are checked against them before a step runs,
as its labels are (runtime/checks.py): TVM's take reads an index past its table unchecked (its
fast mode), where PyTorch's embedding refuses it."""
from __future__ import annotations

import math

from tvm import relax

from pipelines.ir import dtype_of, op_name, shape_of

# ops whose output holds the same integers as their input, rearranged or cast
KEEPS_VALUES = {"relax.astype", "relax.reshape", "relax.flatten", "relax.squeeze",
                "relax.expand_dims", "relax.permute_dims"}


def index_rows(main: relax.Function, inputs: list[relax.Var]) -> dict[str, int]:
    """By input name, the rows of the smallest table ``main`` takes from by that input's
    values; integer inputs that index no table are left out."""
    source = {x: x.name for x in inputs if dtype_of(x).startswith(("int", "uint"))}
    rows: dict[str, int] = {}
    for block in main.body.blocks:
        for binding in block.bindings:
            value, op = binding.value, op_name(binding.value)
            if op in KEEPS_VALUES and value.args[0] in source:
                source[binding.var] = source[value.args[0]]
            elif op == "relax.take" and value.args[1] in source:
                axis = value.attrs.axis
                try:
                    table = shape_of(value.args[0])
                except TypeError:  # a symbolic dimension: no static bound
                    continue
                count = table[int(axis)] if axis is not None else math.prod(table)
                name = source[value.args[1]]
                rows[name] = min(rows.get(name, count), count)
    return rows

