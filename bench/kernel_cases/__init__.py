"""Per-op benchmark cases for `python -m bench.kernels`: each module defines `cases(device, dtype) -> list[Case]`."""
