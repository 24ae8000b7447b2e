"""A user's own modules built around the layers and tensor operations common models use
(tests/frontends/operator_corpus.py: 1-D and 3-D convs, transposed convs, group norm, pooling
variants, interpolation, embedding bags, gather/scatter, cumsum, einsum, masked fills, strided
slices, complex rotations, -inf masks, negative indices, log and division of integers (rounded
too), top-k routing, a reshaped layer scale, detached values and no_grad blocks, an indexer no
gradient reaches, a fixed parameter, an empty split section, patches cut and summed back by
unfold and fold, sliding windows after an empty cache, rows a mask selects mapped by adapters
and written back) compile through the one chain, train the
parameters PyTorch's loss gives a gradient, and take three full-BP SGD-momentum steps as
PyTorch does: the loss and every tensor within rtol 1e-4 (conftest.assert_steps_match)."""
import numpy as np
import pytest
import torch
from conftest import assert_steps_match, model_section, random_batch, twin_of

from pipelines.compile import compile
from pipelines.config import SGD
from pipelines.models.pytorch import selection_of, task_loss

OPT = SGD(kind="sgd", lr=0.05, momentum=0.9)
ENTRIES = ["conv1d_mixer", "conv3d_net", "transposed_convs", "pools", "gather_scatter",
           "strided_rotary", "top_k_router", "indexed_router", "layer_scale", "patches",
           "masked_adapters"]


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_module_of_common_operators_steps_like_pytorch(tmp_path, host_profile, entry):
    model = model_section(frontend="torch", source="tests/frontends/operator_corpus.py",
                          entry=entry, batch_size=2)
    torch.manual_seed(0)
    compiled = compile(model, [{"modules": ["*"]}], OPT, host_profile, tmp_path)
    batches = [random_batch(compiled, seed, classes=4) for seed in range(3)]
    twin = twin_of(compiled, model)
    *inputs, labels = (torch.from_numpy(a) for a in batches[0])
    task_loss("classification", twin(*inputs), labels).backward()
    assert set(selection_of(compiled.signature)) == {
        n for n, p in twin.named_parameters() if p.grad is not None}
    before, after = assert_steps_match(compiled, model, OPT, batches)
    assert any(not np.array_equal(before[k].numpy(), after[k].numpy()) for k in after)
