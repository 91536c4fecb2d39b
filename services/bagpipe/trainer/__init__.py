"""The trainer service: dense model, embedding cache, synchronous data-parallel steps."""
