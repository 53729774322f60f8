"""Run time on this rank: process groups, the collectives' tensor functions and buffers, gradient
buffers, the eager fallback, step accounting, and the state ``compile`` attaches to a model."""
