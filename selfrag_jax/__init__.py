"""selfrag-jax: Self-RAG (retrieve, generate, critique) on JAX and Flax.

Importing the package is cheap and never pulls in TensorFlow, seqio or ScaNN: those are
loaded by the modules that need them (data pipeline, ScaNN index), so the model, trainer
and decoder run on machines without them.
"""

__version__ = "0.1.0"
