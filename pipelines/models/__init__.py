"""The reference models (each a model file a user could have written: an entry function returns
the module and an example batch), and their PyTorch twins: the same update in torch.optim
(torch_twin.py), with LoRA adapters where a case has them (lora.py)."""
