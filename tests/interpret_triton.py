"""Preloaded first by the zerograph-free forkserver (tests/forkserver.py), before torch imports
Triton: Triton reads ``TRITON_INTERPRET`` when it builds its language functions, at import, so a
server that imported it without the variable could never fork a child that interprets kernels
(tests/subprocess_checks.py). A child that must not interpret removes the variable before it
imports zerograph's kernels; zerograph reads it at each call."""
import os

os.environ["TRITON_INTERPRET"] = "1"
