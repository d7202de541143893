"""Pure tensor functions for every attention kind, each with a plain float32 reference beside it."""
