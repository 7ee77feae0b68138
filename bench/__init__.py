# The benchmarks run the engine as `ft` does: freetoken's process defaults (its OpenMP spin and
# CUDA launch queues) are set before any benchmark module imports torch.
import freetoken  # noqa: F401
