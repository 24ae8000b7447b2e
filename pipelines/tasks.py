"""What a model is trained to do (a model's ``task``), which sets the loss and the labels
(training/loss.py; PyTorch's side: models/pytorch.py)."""
TASKS = ("classification", "causal_lm", "masked_lm", "regression")
IGNORE_INDEX = -100  # a label that scores nothing (PyTorch's and transformers' convention)
