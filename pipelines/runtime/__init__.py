"""Running a built step: in this process (step.py), on a board over TVM RPC, under qemu, in a
resource-limited container (remote.py, images.py, emulation.py); and the scripts that run on the
device with only TVM's runtime and numpy (on_device.py, package_entrypoint.py)."""
