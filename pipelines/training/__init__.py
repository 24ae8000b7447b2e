"""Building the training graph: the loss and its gradient at compile time (graph.py), with the
gradient rules TVM lacks (rules.py), the optimizers' updates (optimizers.py), LoRA adapters
(lora.py), and which parameters a scheme trains (scheme.py)."""
