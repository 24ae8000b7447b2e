"""What the stages measure: a case on the host against PyTorch and its peers (case.py: speed,
fine-tuning), on a device (device.py), kernel by kernel (kernel_profile.py)."""
