"""Rewrites of a torch.export program that TVM's importer, or saving the program, cannot
take as PyTorch gives it: what a ``torch.no_grad()`` block computes, detached where it is read
(translating inlines the block and would forget it), and dropped where nothing reads it (a
saved program cannot hold it); a boolean mask's data-dependent selection, where only each
row's last pick is read, with static shapes; and the refusal of a program that draws random
numbers in training mode, writes in forward where the trace cannot follow, or of a module
whose gradient crosses a backward of its own."""
from __future__ import annotations

import operator
import re
from pathlib import Path

import torch

from pipelines.schema import ConfigError

# ops that draw random numbers (in place too: uniform_); dropout's only at a probability above 0
RANDOM = {"bernoulli", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
          "randperm", "uniform", "normal", "exponential", "multinomial", "geometric",
          "log_normal", "cauchy"}
# dropout: (the position of its probability, of its training flag: None where it has none)
DROPOUT = {**dict.fromkeys(["dropout", "native_dropout", "feature_dropout", "alpha_dropout",
                            "feature_alpha_dropout"], (1, 2)),
           "scaled_dot_product_attention": (4, None)}


def module_of(node) -> str:
    """The innermost PyTorch module an FX node ran in, as "path (Type)"."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<model>"
    path, kind = list(stack.values())[-1]
    return f"{path or '<model>'} ({str(kind).rsplit('.', 1)[-1]})"


def refuse_randomness(program: torch.export.ExportedProgram) -> None:
    """A ConfigError naming the first layer of ``program`` that draws random numbers in
    training mode (dropout above 0, stochastic depth, a router's sampling): a compiled step is
    deterministic and cannot draw PyTorch's numbers, and treating the draw as its expectation
    would train another model than PyTorch trains."""
    for node in program.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        name = schema.name.split("::")[-1].rstrip("_")
        if name in DROPOUT:
            at, flag = DROPOUT[name]
            rate = node.args[at] if len(node.args) > at else node.kwargs.get(
                "dropout_p", node.kwargs.get("p", 0.0))
            training = True if flag is None or len(node.args) <= flag else node.args[flag]
            if not training or not rate:
                continue
        elif name not in RANDOM or _unread(node):
            continue
        advice = (f"(aten.{name}, p={rate}); a compiled step is deterministic: set the "
                  "probability to 0 (or the config's *dropout* / *drop_path* settings)"
                  if name in DROPOUT else f"(aten.{name}); a compiled step is deterministic "
                  "and cannot draw PyTorch's numbers")
        raise ConfigError(f"{module_of(node)} draws random numbers in training mode {advice}")


def refuse_data_dependent_shapes(program: torch.export.ExportedProgram) -> None:
    """A ConfigError naming the first layer of ``program`` whose result has a size the data
    decides (``x[mask]``; a split by counts read with ``.tolist()``: JetMoE's tokens per
    expert): a compiled step's shapes are static, and TVM's importer cannot take such a
    size."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in program.graph.nodes:
        value = node.meta.get("val")
        values = value if isinstance(value, (list, tuple)) else [value]
        if node.op != "call_function" or not any(isinstance(v, torch.Tensor)
                                                 and free_unbacked_symbols(v) for v in values):
            continue
        if node.target is torch.ops.aten.index.Tensor:
            raise ConfigError(f"{module_of(node)} indexes a tensor with a boolean mask (x[mask]):"
                              " it selects as many elements as the mask holds, a number the "
                              "data decides, and a compiled step's shapes are static; keep the "
                              "shape: torch.where(mask, x, 0), or x * mask")
        raise ConfigError(f"{module_of(node)} makes a tensor whose size the data decides "
                          f"({node.target}); a compiled step's shapes are static: pad to a "
                          "fixed size and mask, as a mixture of experts' batched path does")


def refuse_untraced_writes(program: torch.export.ExportedProgram) -> None:
    """A ConfigError naming the first layer of ``program`` that writes, in forward, to a tensor
    the trace cannot follow (``weight.data.clamp_(...)``: Gemma 3n's AltUp clips its
    coefficients so): torch.export leaves the write on a detached copy, so the compiled
    forward would read the weight unclipped; a compiled step changes weights by its update
    alone."""
    from torch._subclasses.fake_tensor import FakeTensor

    untraced = {name for name, value in program.constants.items()
                if isinstance(value, FakeTensor)}
    lifted = program.graph_signature.inputs_to_lifted_tensor_constants
    for node in program.graph.nodes:
        if node.op != "placeholder" or lifted.get(node.name) not in untraced:
            continue
        writes = [u for u in node.users if getattr(u.target, "_schema", None) is not None
                  and u.target._schema.name.endswith("_")] or [node]
        frames = re.findall(r'File "(.+?)", line (\d+), in .+\n\s*(.+)',
                            writes[0].meta.get("stack_trace") or "")
        where = (f" at {Path(frames[-1][0]).name}:{frames[-1][1]}: {frames[-1][2].strip()}"
                 if frames else "")
        raise ConfigError(f"{module_of(writes[0])} writes in forward to a tensor torch.export "
                          f"cannot follow ({writes[0].target}{where}): it traces a write to a "
                          "parameter's .data on a detached copy, so the compiled forward would "
                          "not see it, and a compiled step changes weights by its update alone; "
                          "move it out of forward, to run between steps, or turn it off where "
                          "the model's config has a setting for it (models.model.config)")


def _unread(node) -> bool:
    """Whether nothing reads what ``node`` draws: it has no user, nor has the tensor it fills
    in place (BigBird's attention, built afresh for short inputs and initialised at random,
    then given the layer's weights)."""
    filled = node.args[0] if node.target._schema.name.endswith("_") else None
    return not node.users and (filled is None or not isinstance(filled, torch.fx.Node)
                               or all(user is node for user in filled.users))


def no_grad_as_detach(program: torch.export.ExportedProgram) -> None:
    """What a ``torch.no_grad()`` block computes (a ``wrap_with_set_grad_enabled(False, ...)``
    call, which the decompositions inline) detached where it is read: no gradient crosses it,
    as in PyTorch (HRM's early recurrent iterations)."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or "wrap_with_set_grad_enabled" not in str(node.target) \
                or node.args[0] is not False:
            continue
        outputs = [u for u in node.users if u.target is operator.getitem] or [node]
        for output in outputs:
            with graph.inserting_after(output):
                detached = graph.call_function(torch.ops.aten.detach.default, (output,))
            detached.meta["val"] = output.meta.get("val")
            output.replace_all_uses_with(detached, delete_user_cb=lambda u: u is not detached)
    program.graph_module.recompile()


def refuse_custom_backward(module: torch.nn.Module, inputs: dict[str, torch.Tensor],
                           program: torch.export.ExportedProgram) -> None:
    """A ConfigError naming the ``torch.autograd.Function``s whose own backward ``module``'s
    loss crosses where that backward is not the gradient of their forward (YOSO's approximate
    attention gradient, a straight-through estimator): torch.export keeps their forward only,
    and the compiled step would differentiate it, training another model than PyTorch trains.
    One whose backward is its forward's gradient (Bloom's GELU, written out for speed) passes:
    the parameters' gradients through ``module`` and through ``program`` (the forward alone)
    are compared on ``inputs``."""
    custom = _custom_functions(module, inputs)
    if not custom:
        return
    try:
        own, traced = _gradients(module, inputs), _gradients(program.module(), inputs)
        worst = max((float((own[k] - traced[k]).abs().max() / (own[k].abs().max() + 1e-12)), k)
                    for k in own if k in traced)
    except Exception as err:  # the example inputs do not run eagerly: the backward is unseen
        worst = (float("inf"), f"not compared: {type(err).__name__}: {err}")
    if worst[0] > 1e-3:
        raise ConfigError(
            f"{type(module).__name__} computes {sorted(custom)}: a torch.autograd.Function "
            "with a backward of its own, which torch.export does not keep, and which is not "
            f"its forward's gradient (the gradient of {worst[1]} is {worst[0]:.2g} of its "
            "scale off): the compiled step would train another model; write it with "
            "differentiable ops (a straight-through estimator: x + (f(x) - x).detach())")


def _custom_functions(module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> set[str]:
    """The autograd.Functions with a backward of their own in ``module``'s autograd graph on
    ``inputs``: one forward on fake tensors (no memory), or, where the model reads a value
    (XLM's ``lengths.max().item()``), on the weights and copies of the buffers (the running
    statistics stay as they were); none where neither runs (BART's check that every example
    holds an end-of-sentence token, which random example ids do not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_leaves

    try:
        with FakeTensorMode() as mode, torch.enable_grad():
            state = {name: mode.from_tensor(v) for name, v in
                     [*module.named_parameters(), *module.named_buffers()]}
            outputs = torch.func.functional_call(
                module, state, (), {name: mode.from_tensor(v) for name, v in inputs.items()})
    except Exception:  # the fake tensors hold no values to read
        try:
            with torch.enable_grad():
                buffers = {name: v.clone() for name, v in module.named_buffers()}
                outputs = torch.func.functional_call(module, buffers, (), dict(inputs))
        except Exception:
            return set()
    pending = [t.grad_fn for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    seen, custom = set(), set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, torch.autograd.function.BackwardCFunction):
            cls = node._forward_cls
            custom.add(f"{cls.__module__}.{cls.__qualname__}")
        pending.extend(next_node for next_node, _ in node.next_functions)
    return custom


def _gradients(module: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict:
    """The gradient of each parameter of ``module`` for a fixed random weighting of its float
    outputs, its buffers copied (a training-mode batch norm's statistics stay)."""
    from torch.utils._pytree import tree_leaves

    buffers = {name: v.clone() for name, v in module.named_buffers()}
    params = dict(module.named_parameters())
    with torch.enable_grad():
        outputs = torch.func.functional_call(module, buffers, (), dict(inputs))
        generator = torch.Generator().manual_seed(0)
        loss = sum((t * torch.randn(t.shape, generator=generator, dtype=t.dtype)).sum()
                   for t in tree_leaves(outputs)
                   if isinstance(t, torch.Tensor) and t.is_floating_point())
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {name: g for name, g in zip(params, grads) if g is not None}


def drop_unread_grad_blocks(program: torch.export.ExportedProgram) -> None:
    """``program`` without the ``torch.no_grad()`` blocks whose results nothing reads
    (Phi-4 multimodal's check for image tokens in a text-only batch): torch.export.save writes
    such a block without its empty result, and torch.export.load refuses what it wrote."""
    graph = program.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and "wrap_with_set_grad_enabled" in str(node.target) \
                and not node.users:
            body = node.args[1]
            graph.erase_node(node)
            if body.op == "get_attr" and not body.users:
                graph.erase_node(body)
                delattr(program.graph_module, body.target)
    program.graph_module.recompile()


def static_masked_rows(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``program`` with the boolean-mask patterns whose data-dependent size a saved program
    cannot hold (torch.export.load refuses its unbacked size) nor a compiled step's static
    shapes, written with static shapes: each row's last masked position (_last_masked_reads)
    and masked rows mapped row by row (_rowwise_masked_writes). Its runtime checks of the
    masked counts (``_assert_scalar``) go with them (a compiled step checks no data), and the
    program is traced again for its new shapes; a program without them is returned as it is."""
    graph = program.graph
    if not (_last_masked_reads(graph) | _rowwise_masked_writes(graph)):
        return program
    no_grad_as_detach(program)  # tracing again inlines no_grad blocks
    for node in [n for n in graph.nodes if n.target is torch.ops.aten._assert_scalar.default]:
        graph.erase_node(node)
    graph.eliminate_dead_code()
    program.graph_module.recompile()
    return program.run_decompositions({})


def _last_masked_reads(graph) -> bool:
    """``x[mask].view(B, -1, H)[:, -1]`` (BART's, T5's and their kin's classifiers read each
    sentence's last end-of-sentence token so) as ``x[rows, argmax(mask * (1..S))]``: the same
    wherever the rows hold equally many, which transformers checks."""
    aten, rewritten = torch.ops.aten, False
    for node in list(graph.nodes):
        if node.target is not aten.index.Tensor or len(node.args[1]) != 1:
            continue
        x, (mask,) = node.args
        x_val, mask_val = x.meta["val"], getattr(mask, "meta", {}).get("val")
        if mask_val is None or mask_val.dtype != torch.bool or x_val.dim() != 3 \
                or list(mask_val.shape) != list(x_val.shape[:2]):
            continue
        batch, length, width = x_val.shape
        views = [u for u in node.users if u.target in (aten.view.default, aten.reshape.default)
                 and list(u.args[1]) == [batch, -1, width]]
        lasts = [u for v in views for u in v.users
                 if u.target is aten.select.int and tuple(u.args[1:]) == (1, -1)]
        if len(views) != 1 or len(lasts) != 1 or len(views[0].users) != 1:
            continue
        with graph.inserting_before(lasts[0]):
            positions = graph.call_function(aten.arange.start, (1, length + 1),
                                            {"dtype": torch.int64})
            last = graph.call_function(aten.argmax.default, (
                graph.call_function(aten.mul.Tensor, (mask, positions)), 1))
            rows = graph.call_function(aten.arange.default, (batch,), {"dtype": torch.int64})
            picked = graph.call_function(aten.index.Tensor, (x, [rows, last]))
        lasts[0].replace_all_uses_with(picked)
        rewritten = True
    return rewritten


# ops that map each row of their first input alone (over its trailing axes), and elementwise
# ones of rows and of values that do not come from the rows
ROWWISE = {getattr(torch.ops.aten, name).default for name in (
    "linear", "gelu", "relu", "silu", "sigmoid", "tanh", "dropout", "layer_norm")}
ELEMENTWISE = {getattr(torch.ops.aten, name).Tensor for name in ("add", "mul", "sub")}
# in place on the selected rows (``out[mask] += v``), out of place once the rows are all rows
IN_PLACE = {getattr(torch.ops.aten, f"{name}_").Tensor: getattr(torch.ops.aten, name).Tensor
            for name in ("add", "mul", "sub")}
# torch.export's checks of a selected row count (0 <= count <= rows): a compiled step checks
# no data; a count read otherwise is the data's, and refused
COUNT_CHECKS = (operator.ge, operator.le)


def _rowwise_masked_writes(graph) -> bool:
    """``out[mask] = f(x[mask])`` (or ``+=``) where f maps each selected row alone (X-MOD's
    language adapters: linear layers and activations) as ``where(mask, f(x), out)``: f of
    every row, the unselected ones' discarded, so the same values and gradients. torch.export
    threads an in-place write's result to ``out``'s later reads: they read the where."""
    aten, rewritten = torch.ops.aten, False
    masks = [n for n in graph.nodes if getattr(n.meta.get("val"), "dtype", None) == torch.bool]
    for mask in masks:
        selects = [u for u in mask.users if u.target is aten.index.Tensor and u.args[1] == [mask]]
        rank = mask.meta["val"].dim()
        writes, region = _rowwise_region(selects, mask, min(
            (s.args[0].meta["val"].dim() - rank for s in selects), default=0))
        if not writes:
            continue
        for select in selects:
            select.replace_all_uses_with(select.args[0])
        for node in region:
            node.target = IN_PLACE.get(node.target, node.target)
        for write in writes:
            target, _, values = write.args[:3]
            with graph.inserting_before(write):
                keep = graph.call_function(aten.view.default, (
                    mask, list(mask.meta["val"].shape) + [1] * (target.meta["val"].dim() - rank)))
                if len(write.args) > 3 and write.args[3]:  # accumulate
                    values = graph.call_function(aten.add.Tensor, (target, values))
                merged = graph.call_function(aten.where.self, (keep, values, target))
            merged.meta["val"] = write.meta["val"]  # out's shape, for its later selects
            write.replace_all_uses_with(merged)
            graph.erase_node(write)
        rewritten = True
    return rewritten


def _rowwise_region(selects: list, mask, trailing: int) -> tuple[list, set]:
    """(the writes ``out[mask] = ...`` that ``selects`` (x[mask] for any x) reach through
    ROWWISE and ELEMENTWISE ops alone, no other value with a size the data decides among
    their operands; the nodes on the way). No writes where another op reads the rows, or the
    selected rows have no trailing axes of their own (``trailing``) for the ops to map."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    aten, writes, seen = torch.ops.aten, [], set(selects)
    if not selects or trailing < 1:
        return [], seen
    for user in selects[0].graph.nodes:  # in order: a user's operands are seen before it
        nodes = [a for a in user.args if isinstance(a, torch.fx.Node)]
        if user in seen or not any(a in seen for a in nodes):
            continue
        static = all(a in seen or not free_unbacked_symbols(a.meta.get("val")) for a in nodes)
        if user.target in (aten.index_put_.default, aten.index_put.default) \
                and user.args[1] == [mask] and user.args[2] in seen and user.args[0] not in seen:
            writes.append(user)
        elif user.target is aten.sym_size.int and all(
                check.target in COUNT_CHECKS and all(
                    a.target is aten._assert_scalar.default for a in check.users)
                for check in user.users):
            continue
        elif static and (user.target in ROWWISE and nodes[0] in seen
                         or user.target in ELEMENTWISE or user.target in IN_PLACE):
            if user.target is aten.layer_norm.default and len(user.args[1]) > trailing:
                return [], seen
            seen.add(user)
        else:
            return [], seen
    return writes, seen
