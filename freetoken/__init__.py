"""FreeToken: serve very large Mixture-of-Experts models on one GPU plus host RAM."""

__version__ = "0.1.0"
