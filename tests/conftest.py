import os

# Two cores on CI: keep TVM's and PyTorch's thread pools from oversubscribing them.
os.environ.setdefault("TVM_NUM_THREADS", "2")


def chained_steps_match(build_dir, model_cfg: dict, opt_cfg: dict, selection: dict,
                        signature: dict, batches, lora: dict | None = None) -> tuple[dict, dict]:
    """Run the compiled step in ``build_dir`` and PyTorch's step on the same model for each
    (x, y) in ``batches``; the loss must agree within 1e-5 relative at every step and every
    tensor of the state within rtol 1e-4, atol 1e-6 at the end; parameters outside
    ``selection`` stay bit-identical. Returns the state before and after (PyTorch names). With
    ``lora``, the model has those adapters (pipelines/lora.py, seed 0), as the step was built."""
    import numpy as np
    import pytest
    import torch

    from pipelines.models import build_model
    from pipelines.step import CompiledStep
    from pipelines.torch_ref import make_optimizer, train_step

    torch.manual_seed(0)
    model = build_model(model_cfg).train()
    if lora:
        from pipelines.lora import add_adapters
        add_adapters(model, lora, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = CompiledStep(build_dir, {r: before[t].numpy()
                                        for r, t in signature["torch_names"].items()})
    optimizer = make_optimizer(model, opt_cfg, selection)
    for x, y in batches:
        want = train_step(model, optimizer, torch.from_numpy(x), torch.from_numpy(y))
        assert compiled.step(x, y) == pytest.approx(want, rel=1e-5)
    after = compiled.torch_state_dict()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(after[name].numpy(), value.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=name)
        if name not in selection:
            np.testing.assert_array_equal(after[name].numpy(), before[name].numpy())
    return before, after
