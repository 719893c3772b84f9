"""lockserve: LOCKS sparse decoding with the KV cache off the GPU, served with Ray.

The areas are subpackages mapped from the repository's top-level folders:
``lockserve.kernels`` (LOCKS math), ``lockserve.offload`` (where pages live),
``lockserve.workers`` (model, engine, actors), ``lockserve.cluster`` (server,
CLI, experiments) and ``lockserve.configs`` (typed configuration).
Dependencies point one way: cluster -> workers -> offload -> kernels.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
