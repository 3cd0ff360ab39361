"""The devices and kernelize modes pintail's layers are mapped for."""

# CUDA runs the Triton kernels; the CPU runs pintail's torch path (or Triton's interpreter)
DEVICES = ("cuda", "cpu")


def every_mode(repo):
    """`repo` for each device in DEVICES and every kernelize mode (Mode.FALLBACK): pintail's
    layers have a backward and compile."""
    from kernels import Mode

    return {device: {Mode.FALLBACK: repo} for device in DEVICES}
