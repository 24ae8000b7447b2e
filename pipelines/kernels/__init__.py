"""Hand-written kernels (TE definitions) that passes put into the step: the matrix product and
the fused softmax cross-entropy with its gradient."""
