"""Running a built step: in this process (step.py), where a device profile's runner reaches it
(runners/: here, over TVM RPC, under qemu, in a resource-limited container; emulation.py and
images.py make their roots and images), and packaged as a fine-tuning image (package.py) that
ships the native runner (native.py, native_runner.cc: C++ on TVM's runtime library, no
Python) and is checked against its Python twin (python_runner.py); the script that runs a step
on the device with only TVM's runtime and numpy (on_device.py)."""
