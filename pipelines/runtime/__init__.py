"""Running a built step: in this process (step.py), where a device profile's runner reaches it
(runners/: here, over TVM RPC, under qemu, in a resource-limited container; emulation.py and
images.py make their roots and images), and packaged as a fine-tuning image (package.py); the
scripts that run on the device with only TVM's runtime and numpy (on_device.py,
package_entrypoint.py)."""
