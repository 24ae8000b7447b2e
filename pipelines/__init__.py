"""pockengine's library (docs/architecture.md)."""
import os
from pathlib import Path

# PyTorch makes its Inductor cache directory (/tmp/torchinductor_<user> by default) as soon as
# anything touches torch._inductor, compiling or not (creating a torch.optim optimizer does):
# every process that imports pockengine keeps it with pockengine's other caches instead.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      str(Path.home() / ".cache" / "pockengine" / "torchinductor"))
