import os

# Two cores on CI: keep TVM's and PyTorch's thread pools from oversubscribing them.
os.environ.setdefault("TVM_NUM_THREADS", "2")
