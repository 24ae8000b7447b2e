"""The reference models (each a model file a user could have written: an entry function returns
the module and an example batch), and PyTorch's side of every comparison: the same update in
torch.optim (pytorch.py), with LoRA adapters where a case has them (torch_lora.py)."""
