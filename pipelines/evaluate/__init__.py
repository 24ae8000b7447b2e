"""What the stages measure: a case on the host against PyTorch (speed, fine-tuning), on a
device (device.py), kernel by kernel (profile.py), packaged in an image (package.py); searching a
scheme by measured contributions (search.py); and the regression gate over the metrics
(regress.py)."""
