"""FreeToken: serve very large Mixture-of-Experts models on one GPU plus host RAM."""

__version__ = "0.1.0"
# the distribution (pip) name: `freetoken` on PyPI is another project, so ours is installed
# under this name; the import package and the `ft` command are still `freetoken` and `ft`
__distribution__ = "freetoken-moe"

from . import cuda_queues as _cuda_queues  # noqa: E402  (before anything of ours touches CUDA)
from . import omp_env as _omp_env  # noqa: E402  (before anything of ours imports torch)

_cuda_queues.apply()
_omp_env.apply()
