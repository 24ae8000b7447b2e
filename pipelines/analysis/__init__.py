"""Analyses of the training step: what each binding is and what is alive when (liveness), its
costs (FLOPs, bytes, what a scheme removes) and its static memory plan."""
