"""recjax: embedding compression for deep-learning recommendation models in JAX/Flax."""

__version__ = "0.1.0"
