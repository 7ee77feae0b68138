"""FreeToken: serve very large Mixture-of-Experts models on one GPU plus host RAM."""

__version__ = "0.1.0"
# the distribution (pip) name: `freetoken` on PyPI is another project, so ours is installed
# under this name; the import package and the `ft` command are still `freetoken` and `ft`
__distribution__ = "freetoken-moe"

# CUDA's launch queues four times their default depth, unless the user set their own: decode steps
# replayed between a long prompt's layers queue a 40-layer graph behind the layers already
# queued, and with the default depth the host's next launches waited for room (cudaGraphLaunch up
# to 6.5 ms; 414 host calls over 1 ms in a 16k prefill, 104 with 4x, benchmarks/README.md). The
# driver reads it when CUDA starts, so it is set here, before anything of ours touches CUDA.
# llama.cpp's CUDA backend sets the same for the same reason.
import os as _os

_os.environ.setdefault("CUDA_SCALE_LAUNCH_QUEUES", "4x")
